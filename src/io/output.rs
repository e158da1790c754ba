//! Checks a tool runs on its output paths before it reads a model or any data: an output must
//! never replace one of the tool's inputs, a file output must not be a directory, and the place
//! it goes must exist and be writable — so a long run never fails (or destroys an input) at its
//! last step.
//!
//! Two paths are "the same" when they resolve to the same file (symbolic links followed, hard
//! links compared by device and inode); an output that does not exist yet is compared through
//! its canonical parent directory.

use std::path::{Path, PathBuf};

/// Why an output path was refused, naming the flag and the path.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {path}: {problem}")]
pub struct OutputPathError {
    /// The output's flag (`--output`, `--dir`, a recipe key).
    pub flag: String,
    /// The output path.
    pub path: PathBuf,
    /// What is wrong with it.
    pub problem: Box<OutputProblem>,
}

/// What is wrong with an output path.
#[derive(Debug, thiserror::Error)]
pub enum OutputProblem {
    /// The output is one of the inputs (or a file inside an input directory).
    #[error("is the {input_flag} {what} {input}: writing there would replace an input; name another {kind}")]
    IsInput {
        /// The input's flag.
        input_flag: String,
        /// `file`, `directory`, or `directory's contents in`.
        what: &'static str,
        /// The input path.
        input: PathBuf,
        /// `file` or `directory`.
        kind: &'static str,
    },
    /// A file output names a directory.
    #[error("is a directory; name a file in it")]
    IsDirectory,
    /// A directory output names something else.
    #[error("exists and is not a directory")]
    NotDirectory,
    /// The directory a file output goes into does not exist.
    #[error("the directory {0} does not exist; create it first")]
    NoParent(PathBuf),
    /// An output directory cannot be created where it is asked for: this ancestor is a file.
    #[error("cannot be created: {0} is not a directory")]
    Blocked(PathBuf),
    /// The output's directory refuses writes.
    #[error("cannot write in {dir}: {message}")]
    NotWritable {
        /// The directory probed.
        dir: PathBuf,
        /// The OS error.
        message: String,
    },
}

fn refuse(flag: &str, path: &Path, problem: OutputProblem) -> OutputPathError {
    OutputPathError { flag: flag.into(), path: path.into(), problem: Box::new(problem) }
}

/// The canonical form of `p`, or of its parent joined with its name when `p` does not exist.
fn resolved(p: &Path) -> Option<PathBuf> {
    if let Ok(c) = p.canonicalize() {
        return Some(c);
    }
    let name = p.file_name()?;
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(parent.canonicalize().ok()?.join(name))
}

/// Whether `a` and `b` name the same file: one inode, or the same resolved path.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        return x.dev() == y.dev() && x.ino() == y.ino();
    }
    match (resolved(a), resolved(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Whether `dir` is writable by this process: a file is created in it and removed again (the
/// permission bits alone miss read-only mounts and root's exemptions).
fn probe_writable(flag: &str, path: &Path, dir: &Path) -> Result<(), OutputPathError> {
    let probe = dir.join(format!(".glm5-write-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(refuse(flag, path, OutputProblem::NotWritable { dir: dir.into(), message: e.to_string() })),
    }
}

/// The refusal when `output` is one of `inputs` (`(flag, path)`), or an existing file inside
/// an input directory.
fn not_an_input(flag: &str, output: &Path, inputs: &[(&str, &Path)], kind: &'static str) -> Result<(), OutputPathError> {
    let out = resolved(output);
    for (input_flag, input) in inputs {
        let is_dir = input.is_dir();
        let inside = is_dir && output.exists() && out.as_ref().zip(input.canonicalize().ok()).is_some_and(|(o, i)| o.starts_with(i));
        if same_file(output, input) || inside {
            let what = if is_dir && !same_file(output, input) {
                "directory's contents in"
            } else if is_dir {
                "directory"
            } else {
                "file"
            };
            return Err(refuse(flag, output, OutputProblem::IsInput { input_flag: (*input_flag).into(), what, input: input.to_path_buf(), kind }));
        }
    }
    Ok(())
}

/// Check a file output before any work: not an input (nor an existing file inside an input
/// directory), not a directory, in an existing writable directory.
pub fn check_output_file(flag: &str, output: &Path, inputs: &[(&str, &Path)]) -> Result<(), OutputPathError> {
    not_an_input(flag, output, inputs, "file")?;
    if output.is_dir() {
        return Err(refuse(flag, output, OutputProblem::IsDirectory));
    }
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(refuse(flag, output, OutputProblem::NoParent(dir.into())));
    }
    probe_writable(flag, output, dir)
}

/// Check a directory output before any work: not an input and not inside one, and either an
/// existing writable directory or creatable (its nearest existing ancestor is a writable
/// directory).
pub fn check_output_dir(flag: &str, output: &Path, inputs: &[(&str, &Path)]) -> Result<(), OutputPathError> {
    not_an_input(flag, output, inputs, "directory")?;
    if let Some(out) = resolved(output) {
        for (input_flag, input) in inputs {
            if let Ok(i) = input.canonicalize() {
                if input.is_dir() && out.starts_with(&i) {
                    return Err(refuse(
                        flag,
                        output,
                        OutputProblem::IsInput {
                            input_flag: (*input_flag).into(),
                            what: "directory's contents in",
                            input: input.to_path_buf(),
                            kind: "directory",
                        },
                    ));
                }
            }
        }
    }
    if output.exists() {
        if !output.is_dir() {
            return Err(refuse(flag, output, OutputProblem::NotDirectory));
        }
        return probe_writable(flag, output, output);
    }
    // the nearest ancestor that exists must be a directory we can create entries in
    let mut ancestor = output;
    loop {
        ancestor = match ancestor.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        // `symlink_metadata` would stop at a dangling link; `exists` follows links
        if ancestor.exists() {
            break;
        }
        if ancestor == Path::new(".") {
            break;
        }
    }
    if !ancestor.is_dir() {
        return Err(refuse(flag, output, OutputProblem::Blocked(ancestor.into())));
    }
    probe_writable(flag, output, ancestor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("glm5-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn an_input_is_never_an_output() {
        let d = scratch("input");
        let input = d.join("in.safetensors");
        std::fs::write(&input, b"x").unwrap();
        let e = check_output_file("--output", &input, &[("--input", &input)]).unwrap_err();
        assert!(matches!(*e.problem, OutputProblem::IsInput { .. }), "{e}");
        // through another spelling of the same path, and through a hard link
        let dotted = d.join(".").join("in.safetensors");
        assert!(check_output_file("--output", &dotted, &[("--input", &input)]).is_err());
        let link = d.join("link.safetensors");
        std::fs::hard_link(&input, &link).unwrap();
        assert!(check_output_file("--output", &link, &[("--input", &input)]).is_err());
        // an existing file inside an input directory, and the directory itself for a directory output
        let e = check_output_file("--output", &input, &[("--checkpoint", &d)]).unwrap_err();
        assert!(e.to_string().contains("--checkpoint"), "{e}");
        assert!(check_output_dir("--output", &d.join("sub"), &[("--input", &d)]).is_err());
        // a new file beside the input is fine
        assert!(check_output_file("--output", &d.join("out.safetensors"), &[("--input", &input)]).is_ok());
        assert_eq!(std::fs::read(&input).unwrap(), b"x");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn outputs_go_where_they_can_be_written() {
        let d = scratch("where");
        let e = check_output_file("--output", &d, &[]).unwrap_err();
        assert!(matches!(*e.problem, OutputProblem::IsDirectory), "{e}");
        let e = check_output_file("--output", &d.join("missing/out.safetensors"), &[]).unwrap_err();
        assert!(matches!(*e.problem, OutputProblem::NoParent(_)) && e.to_string().contains("missing"), "{e}");
        let file = d.join("file");
        std::fs::write(&file, b"").unwrap();
        let e = check_output_dir("--dir", &file.join("a/b"), &[]).unwrap_err();
        assert!(matches!(*e.problem, OutputProblem::Blocked(_)) && e.to_string().contains("file"), "{e}");
        let e = check_output_dir("--dir", &file, &[]).unwrap_err();
        assert!(matches!(*e.problem, OutputProblem::NotDirectory), "{e}");
        assert!(check_output_dir("--dir", &d.join("new/deeper"), &[]).is_ok());
        assert!(!d.join("new").exists(), "the check creates nothing");
        let _ = std::fs::remove_dir_all(&d);
    }
}
