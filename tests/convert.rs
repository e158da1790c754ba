//! FP8 → BF16 conversion: exact output, sharding with a correct index, and a clean output
//! directory on every failure (truncated shard, lying header, bad scale grid, NaN, missing
//! shard, existing output).

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use glm5_burn::checkpoint::convert::{convert_checkpoint, ConvertOptions};
use glm5_burn::checkpoint::safetensors_io::{serialize, OwnedTensor};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use safetensors::tensor::Dtype;

fn convert(input: &Path, output: &Path, max: usize) -> Result<glm5_burn::checkpoint::convert::ConvertReport, String> {
    let opts = ConvertOptions { max_shard_bytes: max, ..ConvertOptions::default() };
    convert_checkpoint(input, output, &opts, |_, _, _| {}).map_err(|e| e.to_string())
}

fn logits(dir: &Path) -> Vec<f32> {
    let device = Default::default();
    let m = load_causal_lm::<B>(dir, &device, &LoadOptions::default()).unwrap();
    let io = Io::open(&fixtures().join("fp8_oracle.safetensors"));
    host(m.model.forward(io.ids(), &glm5_burn::ForwardOptions::default(), glm5_burn::Outputs::default()).unwrap().logits)
}

#[test]
fn conversion_is_exact_and_loads() {
    let src = fixtures().join("fp8_f32_scales");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bf16");
    let report = convert(&src, &out, usize::MAX).unwrap();
    assert_eq!(report.shards, 1);
    let input = read_all(&src.join("model.safetensors"));
    let output = read_all(&out.join("model.safetensors"));
    let oracle = Io::open(&fixtures().join("fp8_oracle.safetensors"));
    let mut dequantised = 0;
    for (name, t) in &input {
        if name.ends_with("_scale_inv") {
            assert!(!output.contains_key(name), "{name} must not be written");
            continue;
        }
        let o = &output[name];
        assert_eq!(o.shape, t.shape, "{name}");
        if t.dtype == Dtype::F8_E4M3 {
            assert_eq!(o.dtype, Dtype::BF16, "{name}");
            let expected: Vec<u8> =
                oracle.f32(&format!("fp8_f32_scales.{name}")).iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
            assert!(o.data == expected, "{name}: BF16 bits differ from the oracle");
            dequantised += 1;
        } else {
            assert!(o.data == t.data && o.dtype == t.dtype, "{name}: copied tensor changed");
        }
    }
    assert_eq!(dequantised, report.dequantised);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none());
    assert_eq!(logits(&out), logits(&src), "the converted checkpoint computes what the FP8 one does");
}

#[test]
fn f32_output_keeps_exact_products() {
    let src = fixtures().join("fp8_f32_scales");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("f32");
    let opts = ConvertOptions { dtype: Dtype::F32, ..ConvertOptions::default() };
    convert_checkpoint(&src, &out, &opts, |_, _, _| {}).unwrap();
    let input = read_all(&src.join("model.safetensors"));
    let output = read_all(&out.join("model.safetensors"));
    let name = "model.language_model.layers.3.self_attn.q_a_proj.weight";
    let codes = &input[name].data;
    let scales: Vec<f32> = input[&format!("{name}_scale_inv")].data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let got: Vec<f32> = output[name].data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(output[name].dtype, Dtype::F32);
    for (k, (&b, &v)) in codes.iter().zip(&got).enumerate() {
        let (i, j) = (k / 32, k % 32);
        let expected = glm5_burn::checkpoint::fp8::E4M3_TABLE[b as usize] * scales[(i / 16) * 2 + j / 16];
        assert_eq!(v.to_bits(), expected.to_bits(), "[{i}, {j}]");
    }
}

#[test]
fn sharded_output_has_a_correct_index() {
    let src = fixtures().join("fp8_ue8m0_scales");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bf16");
    let report = convert(&src, &out, 40_000).unwrap();
    assert!(report.shards > 3, "{} shards", report.shards);
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut total = 0u64;
    for (name, file) in map {
        let shard = read_all(&out.join(file.as_str().unwrap()));
        let t = shard.get(name).unwrap_or_else(|| panic!("{name} not in {file}"));
        total += t.data.len() as u64;
    }
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    assert!(!out.join("model.safetensors").exists());
    load_causal_lm::<B>(&out, &Default::default(), &LoadOptions::default()).unwrap();
}

/// A broken copy of the FP8 fixture, converted: the error must name `needle`s and leave no
/// output (nor any staging directory) behind.
fn fails_cleanly(edit: impl FnOnce(&Path), needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("fp8");
    std::fs::create_dir(&src).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("fp8_f32_scales").join(f), src.join(f)).unwrap();
    }
    edit(&src);
    let out = tmp.path().join("out");
    let e = convert(&src, &out, usize::MAX).unwrap_err();
    for n in needles {
        assert!(e.contains(n), "error lacks {n:?}: {e}");
    }
    assert!(!out.exists(), "output directory left behind");
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "staging left behind: {leftovers:?}");
}

const W: &str = "model.language_model.layers.3.self_attn.q_a_proj.weight";

fn rewrite(path: &Path, edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) {
    let mut t = read_all(path);
    edit(&mut t);
    std::fs::write(path, serialize(&t).unwrap()).unwrap();
}

#[test]
fn failures_leave_no_output() {
    // truncated shard
    fails_cleanly(
        |d| {
            let p = d.join("model.safetensors");
            let b = std::fs::read(&p).unwrap();
            std::fs::write(&p, &b[..b.len() - 1000]).unwrap();
        },
        &["model.safetensors", "truncated"],
    );
    // a header that lies about offsets: same length, one tensor's end moved by one byte
    fails_cleanly(
        |d| {
            let p = d.join("model.safetensors");
            let mut b = std::fs::read(&p).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
            let mut json: serde_json::Value = serde_json::from_str(header.trim_end()).unwrap();
            let offs = json[W]["data_offsets"].as_array_mut().unwrap();
            let end = offs[1].as_u64().unwrap();
            offs[1] = (end - 1).into();
            let mut text = serde_json::to_string(&json).unwrap().into_bytes();
            assert!(text.len() <= n);
            text.resize(n, b' ');
            b[8..8 + n].copy_from_slice(&text);
            std::fs::write(&p, b).unwrap();
        },
        &["model.safetensors", W],
    );
    // scale grid of the wrong shape
    fails_cleanly(
        |d| rewrite(&d.join("model.safetensors"), |t| t.get_mut(&format!("{W}_scale_inv")).unwrap().shape = vec![1, 4]),
        &["model.safetensors", &format!("{W}_scale_inv"), "[2, 2]"],
    );
    // NaN code
    fails_cleanly(|d| rewrite(&d.join("model.safetensors"), |t| t.get_mut(W).unwrap().data[3] = 0xFF), &["model.safetensors", W, "NaN"]);
    // an index naming a shard that does not exist
    fails_cleanly(
        |d| {
            let names: Vec<String> = read_all(&d.join("model.safetensors")).into_keys().collect();
            std::fs::rename(d.join("model.safetensors"), d.join("model-00001-of-00002.safetensors")).unwrap();
            let mut map = serde_json::Map::new();
            for (i, n) in names.iter().enumerate() {
                map.insert(n.clone(), if i == 0 { "model-00002-of-00002.safetensors" } else { "model-00001-of-00002.safetensors" }.into());
            }
            std::fs::write(d.join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
        },
        &["model-00002-of-00002.safetensors", "does not exist"],
    );
}

#[test]
fn existing_output_is_not_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("keep.txt"), "user data").unwrap();
    let e = convert(&fixtures().join("fp8_f32_scales"), tmp.path(), usize::MAX).unwrap_err();
    assert!(e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read_to_string(tmp.path().join("keep.txt")).unwrap(), "user data");
}

/// The input's tokenizer, chat template and generation config travel with the weights, so the
/// output runs in `generate` as the input did; weights, their index and hidden files do not.
#[test]
fn companion_files_are_copied() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("fp8");
    std::fs::create_dir(&src).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("fp8_f32_scales").join(f), src.join(f)).unwrap();
    }
    let chat = fixtures().join("chat");
    std::fs::copy(chat.join("tokenizer.json"), src.join("tokenizer.json")).unwrap();
    std::fs::copy(chat.join("chat_template.jinja"), src.join("chat_template.jinja")).unwrap();
    std::fs::write(src.join("generation_config.json"), br#"{"eos_token_id": [1]}"#).unwrap();
    std::fs::write(src.join(".lock"), b"").unwrap();
    // another format's weights are not companions
    std::fs::write(src.join("pytorch_model.bin"), b"weights").unwrap();
    let out = tmp.path().join("bf16");
    let report = convert(&src, &out, usize::MAX).unwrap();
    assert_eq!(report.copied, ["chat_template.jinja", "generation_config.json", "tokenizer.json"]);
    for f in &report.copied {
        assert_eq!(std::fs::read(src.join(f)).unwrap(), std::fs::read(out.join(f)).unwrap(), "{f}");
    }
    assert!(!out.join(".lock").exists() && !out.join("pytorch_model.bin").exists());
    assert_eq!(glm5_burn::generate::checkpoint_eos_ids(&out).unwrap(), [1]);
}

/// E4M3FN code → value (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0 is
/// subnormal), written out here from the format's definition.
fn e4m3(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0xF) as i32, (code & 7) as f32);
    sign * if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// `quantize_checkpoint` (`convert --dtype fp8`): the release's FP8 layout streamed from an
/// f32 checkpoint into shards — every decoder MLP weight (dense, shared and routed experts)
/// `F8_E4M3` with an F32 `_scale_inv` per 16×16 block equal to the block's amax / 448 and
/// codes within half an E4M3 step of `w / scale`; every other tensor byte for byte; a
/// `quantization_config`; the result loads (FP8-resident or dequantised) and quantising it
/// again is refused.
#[test]
fn fp8_quantisation_streams_the_release_layout() {
    use glm5_burn::checkpoint::convert::quantize_checkpoint;
    use glm5_burn::checkpoint::safetensors_io::SafetensorsFiles;
    let src = fixtures().join("base_k4");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fp8");
    let report = quantize_checkpoint(&src, &out, [16, 16], 50_000, |_, _, _| {}).unwrap();
    assert!(report.shards > 1, "{report:?}");
    let (input, output) = (SafetensorsFiles::open_dir(&src).unwrap(), SafetensorsFiles::open_dir(&out).unwrap());
    let bytes = |f: &SafetensorsFiles, name: &str| f.row_bytes(name, 0..f.shape(name).unwrap()[0]).unwrap().to_vec();
    let mlp = |name: &str, shape: &[usize]| {
        shape.len() == 2 && name.starts_with("model.language_model.layers.") && name.contains(".mlp.") && name.ends_with("_proj.weight")
    };
    let (mut quantised, mut worst) = (0, 0f32);
    for (name, e) in &input.tensors {
        let got = &output.tensors[name];
        if !mlp(name, &e.shape) {
            assert_eq!((got.dtype, &got.shape), (e.dtype, &e.shape), "{name}");
            assert_eq!(bytes(&output, name), bytes(&input, name), "{name} is copied byte for byte");
            continue;
        }
        quantised += 1;
        assert_eq!(got.dtype, Dtype::F8_E4M3, "{name}");
        let (rows, cols) = (e.shape[0], e.shape[1]);
        let w = input.read_f32(name).unwrap();
        let codes = bytes(&output, name);
        let scale_name = format!("{name}_scale_inv");
        assert_eq!(output.tensors[&scale_name].shape, vec![rows.div_ceil(16), cols.div_ceil(16)]);
        let scales = output.read_f32(&scale_name).unwrap();
        for (bi, s) in scales.iter().enumerate() {
            let (br, bc) = (bi / cols.div_ceil(16), bi % cols.div_ceil(16));
            let cells = || (br * 16..(br * 16 + 16).min(rows)).flat_map(move |r| (bc * 16..(bc * 16 + 16).min(cols)).map(move |c| r * cols + c));
            let amax = cells().map(|i| w[i].abs()).fold(0f32, f32::max);
            let want = if amax == 0.0 { 1.0 } else { amax / 448.0 };
            assert!((s - want).abs() <= 1e-6 * want, "{scale_name}[{br}, {bc}]: {s} vs amax / 448 = {want}");
            for i in cells() {
                let (x, q) = (w[i] / s, e4m3(codes[i]));
                let step = 2f32.powi((q.abs().max(2f32.powi(-6)).log2().floor() as i32) - 3);
                worst = worst.max((x - q).abs() / step);
                assert!((x - q).abs() <= 0.5 * step * (1.0 + 1e-5), "{name}[{}, {}]: w/s {x} coded {q}", i / cols, i % cols);
            }
        }
    }
    println!("{quantised} weights quantised ({:?}), worst |w/s − e4m3| {worst:.3} of a step", report);
    assert!(quantised > 0 && quantised == report.quantised);
    assert_eq!(output.tensors.len(), input.tensors.len() + quantised);
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["weight_block_size"], serde_json::json!([16, 16]));
    // it loads, kept in FP8 or dequantised
    let device = Default::default();
    load_causal_lm::<B>(&out, &device, &LoadOptions { fp8_base: true, ..LoadOptions::default() }).unwrap();
    load_causal_lm::<B>(&out, &device, &LoadOptions::default()).unwrap();
    let again = quantize_checkpoint(&out, &tmp.path().join("again"), [16, 16], 50_000, |_, _, _| {}).unwrap_err().to_string();
    assert!(again.contains("already FP8"), "{again}");
    assert!(!tmp.path().join("again").exists());
}
