//! MedPix-VQA reading: the bundled HF-layout parquet (written by pyarrow in
//! `examples/data/make_tiny_medpix.py`) and the JSONL + image-folder fixture written by the same
//! script from the same records agree record for record; malformed records are skipped and
//! counted by reason; an empty split and a schema without the answer column are clear errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use glm5_burn::data::chat::ChatFormat;
use glm5_burn::data::image_processor::ImageProcessor;
use glm5_burn::data::loader::{PackedDataset, PackingOptions};
use glm5_burn::data::medpix::read_split;
use glm5_burn::data::{DatasetFormat, DatasetSource};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn bundle() -> PathBuf {
    root().join("examples/data/tiny_medpix")
}

#[test]
fn parquet_and_jsonl_agree_and_bad_records_are_counted() {
    let (pq, report) = read_split(&bundle(), DatasetFormat::Parquet, "train", None).unwrap();
    assert_eq!((report.read, report.usable), (163, 160));
    let reasons: Vec<(&str, usize)> = report.skipped.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(reasons, vec![("empty answer", 1), ("missing image", 1), ("undecodable image", 1)], "{:?}", report.examples);
    assert!(report.examples.iter().any(|e| e.contains("train-00000-of-00001.parquet:row 5")), "{:?}", report.examples);
    let (val, _) = read_split(&bundle(), DatasetFormat::Parquet, "validation", None).unwrap();
    assert_eq!(val.len(), 24);

    let (js, jreport) = read_split(&root().join("tests/fixtures/medpix_jsonl"), DatasetFormat::Jsonl, "train", None).unwrap();
    assert_eq!((jreport.read, jreport.usable), (10, 6));
    assert_eq!(jreport.skipped.get("malformed JSON"), Some(&1));
    assert_eq!(jreport.skipped_total(), 4);
    for (a, b) in pq.iter().zip(&js) {
        assert_eq!((&a.question, &a.answer, &a.case_id, &a.mode), (&b.question, &b.answer, &b.case_id, &b.mode));
        assert_eq!(a.image_bytes, b.image_bytes);
        assert_eq!((a.width, a.height), (112, 112));
    }
    let (few, _) = read_split(&bundle(), DatasetFormat::Parquet, "train", Some(7)).unwrap();
    assert_eq!(few.len(), 7);
}

#[test]
fn unusable_datasets_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.jsonl"), "{\"image\": \"nope.png\", \"question\": \"q\", \"answer\": \"a\"}\nnot json\n").unwrap();
    let e = read_split(dir.path(), DatasetFormat::Jsonl, "train", None).unwrap_err().to_string();
    assert!(e.contains("no usable records") && e.contains("1× missing image") && e.contains("1× malformed JSON"), "{e}");
    let e = read_split(dir.path(), DatasetFormat::Jsonl, "validation", None).unwrap_err().to_string();
    assert!(e.contains("validation.jsonl"), "{e}");
    let e = read_split(dir.path(), DatasetFormat::Parquet, "train", None).unwrap_err().to_string();
    assert!(e.contains("no parquet shards for split `train`"), "{e}");

    // a shard without the answer column
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let q: ArrayRef = Arc::new(StringArray::from(vec!["q"]));
    let img: ArrayRef = Arc::new(arrow_array::BinaryArray::from(vec![&b"x"[..]]));
    let batch = RecordBatch::try_from_iter([("image_id", img), ("question", q)]).unwrap();
    let path = data.join("train-00000-of-00001.parquet");
    let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let e = read_split(dir.path(), DatasetFormat::Parquet, "train", None).unwrap_err().to_string();
    assert!(e.contains("train-00000-of-00001.parquet") && e.contains("column `answer`: missing"), "{e}");
    std::fs::write(&path, b"PAR1 garbage").unwrap();
    let e = read_split(dir.path(), DatasetFormat::Parquet, "train", None).unwrap_err().to_string();
    assert!(e.contains("not a readable parquet file"), "{e}");
}

#[test]
fn packs_hold_whole_conversations() {
    let chat = ChatFormat::from_dir(&bundle()).unwrap();
    let image_token = chat.tokenizer.token_to_id("<|image|>").unwrap() as i64;
    let opts = PackingOptions { max_length: 256, drop_long_samples: true, seed: 3 };
    let ds = PackedDataset::build(
        &DatasetSource { path: bundle(), format: DatasetFormat::Parquet, split: "train".into(), max_samples: None },
        &chat,
        ImageProcessor::default(),
        image_token,
        &opts,
    )
    .unwrap();
    assert_eq!(ds.pack_report.samples, 160);
    assert!(ds.packs.iter().all(|p| p.len() <= 256));
    assert!(ds.pack_report.fill > 0.8, "greedy packing fills the packs: {}", ds.pack_report.fill);
    let mb = ds.micro_batch(&[0, 1]).unwrap();
    let docs = mb.documents.clone().unwrap();
    assert_eq!(docs.len(), ds.packs[0].samples.len() + ds.packs[1].samples.len());
    assert_eq!(docs.iter().sum::<usize>(), mb.seq);
    let images = mb.images.as_ref().unwrap();
    assert_eq!(images.grid_thw.len(), docs.len(), "one image per conversation");
    // every placeholder gets one merged feature: 112×112 → 8×8 patches → 16 tokens
    assert_eq!(mb.ids.iter().filter(|&&t| t == image_token).count(), 16 * docs.len());
    // labels only on answers: each document's first label is masked
    let mut start = 0;
    for &d in &docs {
        assert_eq!(mb.labels[start], -100);
        assert!(mb.labels[start..start + d].iter().any(|&l| l >= 0));
        start += d;
    }
    let tiny = PackingOptions { max_length: 16, drop_long_samples: true, seed: 3 };
    let e = PackedDataset::build(
        &DatasetSource { path: bundle(), format: DatasetFormat::Parquet, split: "train".into(), max_samples: None },
        &chat,
        ImageProcessor::default(),
        image_token,
        &tiny,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("every sample is longer than packed_sequence_size 16"), "{e}");
}

/// A question or answer holding a special-token string (`<|image|>` would become a second
/// image placeholder) is skipped and counted like other malformed records, not a reason to
/// abort the split.
#[test]
fn special_token_text_is_skipped_and_counted() {
    let src = root().join("tests/fixtures/medpix_jsonl");
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = std::fs::read_to_string(src.join("train.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| l.replace("\"images/", &format!("\"{}/images/", src.display())))
        .collect();
    let mut edited = lines.clone();
    edited[0] = edited[0].replace("Is the kidney lesion", "Is the <|image|> kidney lesion");
    edited[1] = edited[1].replace("\"answer\": \"", "\"answer\": \"<|endoftext|> ");
    std::fs::write(dir.path().join("train.jsonl"), edited.join("\n") + "\n").unwrap();
    let chat = ChatFormat::from_dir(&bundle()).unwrap();
    let image_token = chat.tokenizer.token_to_id("<|image|>").unwrap() as i64;
    let opts = PackingOptions { max_length: 256, drop_long_samples: true, seed: 3 };
    let ds = PackedDataset::build(
        &DatasetSource { path: dir.path().to_path_buf(), format: DatasetFormat::Jsonl, split: "train".into(), max_samples: None },
        &chat,
        ImageProcessor::default(),
        image_token,
        &opts,
    )
    .unwrap();
    let special = ds.read_report.skipped.get("special token in text").copied().unwrap_or(0);
    // both strings are special tokens of the bundled tokenizer (tokenizer.json `added_tokens`)
    let expected = 2;
    assert_eq!(special, expected, "{:?}", ds.read_report.skipped);
    assert!(ds.read_report.examples.iter().any(|e| e.contains("contains <|image|>")), "{:?}", ds.read_report.examples);
    let clean = PackedDataset::build(
        &DatasetSource { path: src.clone(), format: DatasetFormat::Jsonl, split: "train".into(), max_samples: None },
        &chat,
        ImageProcessor::default(),
        image_token,
        &opts,
    )
    .unwrap();
    assert_eq!(ds.read_report.usable + expected, clean.read_report.usable);
}
