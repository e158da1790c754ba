//! The `logits` example's input checks: every bad input is a clear error naming the problem.

mod common;

use std::collections::BTreeMap;

use glm5_burn::checkpoint::safetensors_io::{serialize, OwnedTensor};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::io::TokenInputs;
use safetensors::tensor::Dtype;

fn write(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    let map: BTreeMap<String, OwnedTensor> =
        tensors.iter().map(|(n, d, s, b)| (n.to_string(), OwnedTensor { dtype: *d, shape: s.clone(), data: b.clone() })).collect();
    std::fs::write(f.path(), serialize(&map).unwrap()).unwrap();
    f
}

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn err(f: &tempfile::NamedTempFile) -> String {
    TokenInputs::read(f.path()).unwrap_err().to_string()
}

#[test]
fn bad_inputs_are_clear_errors() {
    let e = TokenInputs::read(std::path::Path::new("/nonexistent/in.safetensors")).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/in.safetensors") && e.contains("cannot read"), "{e}");

    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), b"not safetensors").unwrap();
    assert!(err(&f).contains("not a valid safetensors"));

    let f = write(&[("other", Dtype::I64, vec![1, 2], i64s(&[1, 2]))]);
    assert!(err(&f).contains("no `input_ids`"));

    let f = write(&[("input_ids", Dtype::I32, vec![1, 2], vec![0; 8])]);
    assert!(err(&f).contains("must be I64"), "{}", err(&f));

    let f = write(&[("input_ids", Dtype::I64, vec![3], i64s(&[1, 2, 3]))]);
    assert!(err(&f).contains("rank 2"), "{}", err(&f));

    let f = write(&[("input_ids", Dtype::I64, vec![1, 2], i64s(&[1, 2])), ("attention_mask", Dtype::I64, vec![1, 3], i64s(&[1, 1, 1]))]);
    assert!(err(&f).contains("differs"), "{}", err(&f));

    let f = write(&[("input_ids", Dtype::I64, vec![1, 2], i64s(&[1, 2])), ("attention_mask", Dtype::I64, vec![1, 2], i64s(&[1, 2]))]);
    assert!(err(&f).contains("0 or 1"), "{}", err(&f));

    let f = write(&[("input_ids", Dtype::I64, vec![1, 2], i64s(&[1, 2]))]);
    let ok = TokenInputs::read(f.path()).unwrap();
    assert_eq!(ok.mask, vec![true, true]);
}

#[test]
fn token_ids_outside_the_vocabulary_are_rejected() {
    let m = load_causal_lm::<common::B>(&common::fixtures().join("base_k4"), &Default::default(), &LoadOptions::default()).unwrap();
    let e = m.model.check_ids(&[1, 2, 128]).unwrap_err().to_string();
    assert!(e.contains("128") && e.contains("vocabulary"), "{e}");
    assert!(m.model.check_ids(&[-1]).is_err());
    m.model.check_ids(&[0, 127]).unwrap();
}
