//! MedPix-VQA records: the Hugging Face layout (parquet shards whose `image_id` column is the
//! `datasets` Image struct `{bytes, path}`, plus `mode`, `case_id`, `question`, `answer`) read with
//! the Arrow/Parquet crates, or JSONL lines (`image`, `question`, `answer`, optional `case_id`,
//! `mode`) beside an image folder.
//!
//! Shards of a split are found as `DIR/**/SPLIT-*.parquet` (the Hub's `data/train-00000-of-00001.parquet`)
//! or `DIR/SPLIT/*.parquet`; JSONL as `DIR/SPLIT.jsonl`. Image paths resolve against the shard's
//! or the JSONL file's directory. A record whose image is missing or does not decode, or whose
//! question or answer is empty, is skipped and counted by reason; a split left with no usable
//! record is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow_array::{Array, BinaryArray, LargeBinaryArray, LargeStringArray, RecordBatch, StringArray, StructArray};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::image_processor::RgbImage;
use super::DatasetFormat;

/// One usable question–answer pair. The image is kept encoded (decoded once to validate it and
/// read its size) so a large dataset does not sit in memory as pixels.
#[derive(Debug, Clone)]
pub struct VqaRecord {
    /// The encoded image (shared between records of one image).
    pub image_bytes: std::sync::Arc<[u8]>,
    /// Image width.
    pub width: usize,
    /// Image height.
    pub height: usize,
    /// The question.
    pub question: String,
    /// The reference answer.
    pub answer: String,
    /// MedPix case id.
    pub case_id: String,
    /// Imaging modality (`CT`, `MRI`, …).
    pub mode: String,
    /// `file:row` (parquet) or `file:line` (JSONL), for messages.
    pub origin: String,
}

impl VqaRecord {
    /// Decode the image.
    pub fn image(&self) -> Result<RgbImage, super::image_processor::ImageError> {
        RgbImage::decode(&self.image_bytes, &self.origin)
    }
}

/// Records read and skipped, by reason.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadReport {
    /// Files read.
    pub files: Vec<PathBuf>,
    /// Records read.
    pub read: usize,
    /// Records kept.
    pub usable: usize,
    /// reason → count
    pub skipped: BTreeMap<String, usize>,
    /// The first few skipped records with their reason, for the log.
    pub examples: Vec<String>,
}

impl ReadReport {
    /// Records skipped for any reason.
    pub fn skipped_total(&self) -> usize {
        self.skipped.values().sum()
    }

    /// The error for a split left without a usable record, with the skip counts by reason.
    pub(crate) fn no_usable_records(&self, dir: &Path, split: &str) -> DatasetError {
        let reasons = if self.skipped.is_empty() {
            "the split is empty".to_string()
        } else {
            self.skipped.iter().map(|(r, n)| format!("{n}× {r}")).collect::<Vec<_>>().join(", ")
        };
        DatasetError::Empty { path: dir.display().to_string(), split: split.into(), read: self.read, skipped: self.skipped_total(), reasons }
    }

    pub(crate) fn skip(&mut self, origin: &str, reason: &str, detail: String) {
        *self.skipped.entry(reason.to_string()).or_default() += 1;
        if self.examples.len() < 8 {
            self.examples.push(format!("{origin}: {reason}: {detail}"));
        }
    }
}

/// Dataset errors, naming the file or column.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A file could not be read or parsed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// A column is missing or has the wrong type.
    #[error("{path}: column `{column}`: {message}")]
    Column {
        /// The file.
        path: String,
        /// The column.
        column: String,
        /// What is wrong.
        message: String,
    },
    /// A split has no usable record.
    #[error("{path}: no usable records in split `{split}` ({read} read, {skipped} skipped: {reasons})")]
    Empty {
        /// The dataset path.
        path: String,
        /// The split.
        split: String,
        /// Records read.
        read: usize,
        /// Records skipped.
        skipped: usize,
        /// Skip counts by reason.
        reasons: String,
    },
}

fn file_err(path: &Path, message: impl std::fmt::Display) -> DatasetError {
    DatasetError::File { path: path.display().to_string(), message: message.to_string() }
}

/// Read one split. `max_samples` stops after that many usable records.
pub fn read_split(dir: &Path, format: DatasetFormat, split: &str, max_samples: Option<usize>) -> Result<(Vec<VqaRecord>, ReadReport), DatasetError> {
    let mut report = ReadReport::default();
    let mut out = Vec::new();
    let limit = max_samples.unwrap_or(usize::MAX);
    match format {
        DatasetFormat::Parquet => {
            let files = parquet_files(dir, split)?;
            for f in &files {
                if out.len() >= limit {
                    break;
                }
                read_parquet(f, &mut out, &mut report, limit)?;
            }
            report.files = files;
        }
        DatasetFormat::Jsonl => {
            let f = dir.join(format!("{split}.jsonl"));
            if !f.is_file() {
                return Err(file_err(&f, format!("no JSONL file for split `{split}` (expected DIR/{split}.jsonl)")));
            }
            read_jsonl(&f, &mut out, &mut report, limit)?;
            report.files = vec![f];
        }
    }
    report.usable = out.len();
    if out.is_empty() {
        return Err(report.no_usable_records(dir, split));
    }
    Ok((out, report))
}

/// The parquet shards of `split`, sorted.
pub(crate) fn parquet_files(dir: &Path, split: &str) -> Result<Vec<PathBuf>, DatasetError> {
    if !dir.is_dir() {
        return Err(file_err(dir, "dataset directory does not exist"));
    }
    let mut found = Vec::new();
    let prefix = format!("{split}-");
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| file_err(&d, e))?;
        for e in entries {
            let p = e.map_err(|e| file_err(&d, e))?.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let in_split_dir = p.parent().and_then(|x| x.file_name()).and_then(|n| n.to_str()) == Some(split);
            if name.ends_with(".parquet") && (name.starts_with(&prefix) || in_split_dir) {
                found.push(p);
            }
        }
    }
    found.sort();
    if found.is_empty() {
        return Err(file_err(dir, format!("no parquet shards for split `{split}` (looked for **/{split}-*.parquet and {split}/*.parquet)")));
    }
    Ok(found)
}

/// A string column as owned optional values.
fn strings(batch: &RecordBatch, path: &Path, name: &str, required: bool) -> Result<Vec<Option<String>>, DatasetError> {
    let col_err = |m: String| DatasetError::Column { path: path.display().to_string(), column: name.into(), message: m };
    let Some(col) = batch.column_by_name(name) else {
        return if required { Err(col_err("missing".into())) } else { Ok(vec![None; batch.num_rows()]) };
    };
    if let Some(a) = col.as_any().downcast_ref::<StringArray>() {
        return Ok((0..a.len()).map(|i| a.is_valid(i).then(|| a.value(i).to_string())).collect());
    }
    if let Some(a) = col.as_any().downcast_ref::<LargeStringArray>() {
        return Ok((0..a.len()).map(|i| a.is_valid(i).then(|| a.value(i).to_string())).collect());
    }
    Err(col_err(format!("expected a string column, found {}", col.data_type())))
}

/// An image cell: its bytes and/or its path.
type ImageCell = (Option<Vec<u8>>, Option<String>);

/// The `image_id` column: the `datasets` Image struct `{bytes, path}` (or plain binary).
fn images(batch: &RecordBatch, path: &Path, name: &str) -> Result<Vec<ImageCell>, DatasetError> {
    let col_err = |m: String| DatasetError::Column { path: path.display().to_string(), column: name.into(), message: m };
    let col = batch.column_by_name(name).ok_or_else(|| col_err("missing (the image column of MedPix-VQA)".into()))?;
    let binary = |a: &dyn Array, i: usize| -> Option<Vec<u8>> {
        if let Some(b) = a.as_any().downcast_ref::<BinaryArray>() {
            return b.is_valid(i).then(|| b.value(i).to_vec());
        }
        if let Some(b) = a.as_any().downcast_ref::<LargeBinaryArray>() {
            return b.is_valid(i).then(|| b.value(i).to_vec());
        }
        None
    };
    let n = batch.num_rows();
    if let Some(s) = col.as_any().downcast_ref::<StructArray>() {
        let bytes = s.column_by_name("bytes").ok_or_else(|| col_err("struct without a `bytes` field".into()))?;
        let paths = s.column_by_name("path");
        let path_at = |i: usize| -> Option<String> {
            let p = paths?;
            if let Some(a) = p.as_any().downcast_ref::<StringArray>() {
                return a.is_valid(i).then(|| a.value(i).to_string());
            }
            if let Some(a) = p.as_any().downcast_ref::<LargeStringArray>() {
                return a.is_valid(i).then(|| a.value(i).to_string());
            }
            None
        };
        return Ok((0..n).map(|i| if s.is_valid(i) { (binary(bytes.as_ref(), i), path_at(i)) } else { (None, None) }).collect());
    }
    if col.as_any().downcast_ref::<BinaryArray>().is_some() || col.as_any().downcast_ref::<LargeBinaryArray>().is_some() {
        return Ok((0..n).map(|i| (binary(col.as_ref(), i), None)).collect());
    }
    Err(col_err(format!("expected the Image struct {{bytes, path}} or binary, found {}", col.data_type())))
}

/// One record's fields as a file holds them, before validation.
struct RawRecord {
    /// `file:row` or `file:line`.
    origin: String,
    /// Image bytes stored in the record.
    bytes: Option<Vec<u8>>,
    /// Or the image file it names.
    image_path: Option<PathBuf>,
    question: Option<String>,
    answer: Option<String>,
    case_id: Option<String>,
    mode: Option<String>,
}

/// Validate and keep one record; reasons are counted in `report`.
fn accept(out: &mut Vec<VqaRecord>, report: &mut ReadReport, raw: RawRecord) {
    let RawRecord { origin, bytes, image_path, question, answer, case_id, mode } = raw;
    let question = question.unwrap_or_default();
    let answer = answer.unwrap_or_default();
    if question.trim().is_empty() {
        return report.skip(&origin, "empty question", String::new());
    }
    if answer.trim().is_empty() {
        return report.skip(&origin, "empty answer", String::new());
    }
    let bytes = match (bytes, image_path) {
        (Some(b), _) if !b.is_empty() => b,
        (_, Some(p)) => match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) => return report.skip(&origin, "missing image", format!("{}: {e}", p.display())),
        },
        _ => return report.skip(&origin, "missing image", "no bytes and no path".into()),
    };
    let img = match RgbImage::decode(&bytes, "image") {
        Ok(i) => i,
        Err(e) => return report.skip(&origin, "undecodable image", e.to_string()),
    };
    out.push(VqaRecord {
        image_bytes: bytes.into(),
        width: img.width,
        height: img.height,
        question,
        answer: answer.trim().to_string(),
        case_id: case_id.unwrap_or_default(),
        mode: mode.unwrap_or_default(),
        origin,
    });
}

fn read_parquet(path: &Path, out: &mut Vec<VqaRecord>, report: &mut ReadReport, limit: usize) -> Result<(), DatasetError> {
    let file = std::fs::File::open(path).map_err(|e| file_err(path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.with_batch_size(256).build())
        .map_err(|e| file_err(path, format!("not a readable parquet file: {e}")))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut row = 0usize;
    for batch in reader {
        let batch = batch.map_err(|e| file_err(path, format!("row group after row {row}: {e}")))?;
        let imgs = images(&batch, path, "image_id")?;
        let q = strings(&batch, path, "question", true)?;
        let a = strings(&batch, path, "answer", true)?;
        let c = strings(&batch, path, "case_id", false)?;
        let m = strings(&batch, path, "mode", false)?;
        for (i, (bytes, img_path)) in imgs.into_iter().enumerate() {
            if out.len() >= limit {
                return Ok(());
            }
            report.read += 1;
            let origin = format!("{}:row {}", path.display(), row + i);
            let img_path = img_path.map(|p| base.join(p));
            let raw = RawRecord {
                origin,
                bytes,
                image_path: img_path,
                question: q[i].clone(),
                answer: a[i].clone(),
                case_id: c[i].clone(),
                mode: m[i].clone(),
            };
            accept(out, report, raw);
        }
        row += batch.num_rows();
    }
    Ok(())
}

fn read_jsonl(path: &Path, out: &mut Vec<VqaRecord>, report: &mut ReadReport, limit: usize) -> Result<(), DatasetError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e))?;
    let base = path.parent().unwrap_or(Path::new("."));
    for (i, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        report.read += 1;
        let origin = format!("{}:line {}", path.display(), i + 1);
        let v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                report.skip(&origin, "malformed JSON", e.to_string());
                continue;
            }
        };
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let image = s("image").map(|p| base.join(p));
        let raw = RawRecord {
            origin,
            bytes: None,
            image_path: image,
            question: s("question"),
            answer: s("answer"),
            case_id: s("case_id"),
            mode: s("mode"),
        };
        accept(out, report, raw);
    }
    Ok(())
}
