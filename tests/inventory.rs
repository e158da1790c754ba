//! The checkpoint inventory (names and shapes for a config) against what HF's
//! `save_pretrained` writes (vision tower included) for every fixture config.

mod common;

use std::collections::BTreeMap;

use glm5_burn::checkpoint::inventory::{inventory, Part};
use glm5_burn::checkpoint::read_config;

#[test]
fn inventory_matches_save_pretrained() {
    let mut n = 0;
    for entry in std::fs::read_dir(common::fixtures()).unwrap() {
        let path = entry.unwrap().path();
        let Some(case) = path.file_name().unwrap().to_str().unwrap().strip_suffix(".published.json") else { continue };
        let published: BTreeMap<String, Vec<usize>> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let config = read_config(&common::fixtures().join(case)).unwrap().resolved;
        let ours: BTreeMap<String, Vec<usize>> = inventory(&config, false, true).into_iter().map(|e| (e.name, e.shape)).collect();
        let missing: Vec<_> = published.keys().filter(|k| !ours.contains_key(*k)).collect();
        let extra: Vec<_> = ours.keys().filter(|k| !published.contains_key(*k)).collect();
        assert!(missing.is_empty() && extra.is_empty(), "{case}: not in our inventory {missing:?}; not published {extra:?}");
        for (k, shape) in &published {
            assert_eq!(&ours[k], shape, "{case}: {k}");
        }
        // the MTP block adds only keys at index num_hidden_layers
        let mtp: Vec<_> = inventory(&config, true, false).into_iter().filter(|e| e.part == Part::Mtp).collect();
        assert_eq!(mtp.len(), 0, "{case}: fixtures have num_nextn_predict_layers = 0");
        n += 1;
    }
    assert!(n >= 10, "only {n} published inventories found");
}
