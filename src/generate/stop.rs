//! Stop strings (HF `StopStringCriteria`): a row ends once a stop string appears in its decoded
//! text overlapping the newest token.
//!
//! ```text
//! tail   = the row's last W tokens (W = the longest stop string's length in bytes + 1)
//! text   = decode(tail),  before = decode(tail without its last token)
//! ends  ⇔ ∃ s, i: text[i .. i+|s|] == s  and  i + |s| > |before|
//! ```
//!
//! HF matches the strings against the vocabulary's token strings with tensor ops; this decodes
//! the tail with the tokenizer instead, which gives the same answer for tokenizers whose
//! decoding of a token sequence is the concatenation of the tokens' texts (byte-level BPE
//! within whole characters). As in HF, a stop string only ends a row when the newest token
//! helps form it (an occurrence further back never stops generation), and the prompt's tail
//! counts: a stop string the first generated token completes ends the row.

use tokenizers::Tokenizer;

use super::decode::{GenerateError, StoppingCriteria};

/// Stop strings, decoded with `tokenizer`.
pub struct StopStrings<'a> {
    tokenizer: &'a Tokenizer,
    strings: Vec<String>,
    window: usize,
}

impl<'a> StopStrings<'a> {
    /// `strings` must be non-empty strings.
    pub fn new(tokenizer: &'a Tokenizer, strings: &[String]) -> Result<Self, GenerateError> {
        if let Some(i) = strings.iter().position(|s| s.is_empty()) {
            return Err(GenerateError::Input(format!("stop string {i} is empty")));
        }
        // every token decodes to at least one byte here, so the longest string spans at most
        // that many tokens, plus one for the newest token's overhang
        let window = strings.iter().map(|s| s.len()).max().unwrap_or(0) + 1;
        Ok(Self { tokenizer, strings: strings.to_vec(), window })
    }

    fn decode(&self, ids: &[i64]) -> String {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.tokenizer.decode(&ids, false).unwrap_or_default()
    }
}

impl StoppingCriteria for StopStrings<'_> {
    fn ends(&mut self, _row: usize, sequence: &[i64]) -> bool {
        if self.strings.is_empty() || sequence.is_empty() {
            return false;
        }
        let tail = &sequence[sequence.len().saturating_sub(self.window)..];
        let text = self.decode(tail);
        let before = self.decode(&tail[..tail.len() - 1]).len();
        self.strings.iter().any(|s| text.match_indices(s.as_str()).any(|(i, _)| i + s.len() > before))
    }
}
