//! Chat format: the checkpoint's own Jinja chat template rendered with minijinja (HF's
//! settings: `trim_blocks`, `lstrip_blocks`), each `<|image|>` expanded to the image's
//! `gh·gw / merge²` placeholders, tokenised with the checkpoint's `tokenizer.json`, and SFT
//! labels: the tokens overlapping the template's `{% generation %}` spans (the assistant
//! content and whatever ends the turn there), `-100` everywhere else.
//!
//! This follows HF `ProcessorMixin.apply_chat_template(..., return_assistant_tokens_mask=True)`:
//! generation spans are recorded in the rendered text, shifted past expanded image
//! placeholders, and a token is labelled when its character span overlaps one.

use std::ops::Range;
use std::path::Path;

use serde_json::Value;
use tokenizers::Tokenizer;

/// Errors of the chat pipeline, naming the file or message at fault.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A file could not be read or parsed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// The template does not compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// A conversation the template cannot format.
    #[error("conversation: {0}")]
    Conversation(String),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

/// Token ids and labels of one conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// `-100` except on the tokens the model is trained to produce.
    pub labels: Vec<i64>,
}

/// A tokenizer with its chat template.
pub struct ChatFormat {
    /// The tokenizer (`tokenizer.json`).
    pub tokenizer: Tokenizer,
    template: String,
    /// The image placeholder as text (`<|image|>`).
    pub image_token: String,
}

impl ChatFormat {
    /// `tokenizer.json` plus the template: `chat_template.jinja` beside it, or the
    /// `chat_template` field of `tokenizer_config.json`. `dir` is the directory holding them,
    /// or the `tokenizer.json` file itself (every tool's `--tokenizer` takes either).
    pub fn from_dir(dir: &Path) -> Result<Self, ChatError> {
        let (dir, tok) = if dir.is_file() {
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            (parent, dir.to_path_buf())
        } else {
            (dir, dir.join("tokenizer.json"))
        };
        let jinja = dir.join("chat_template.jinja");
        let template = if jinja.exists() {
            std::fs::read_to_string(&jinja).map_err(|e| ChatError::File { path: jinja.display().to_string(), message: e.to_string() })?
        } else {
            let cfg = dir.join("tokenizer_config.json");
            let text = std::fs::read_to_string(&cfg)
                .map_err(|e| ChatError::File { path: cfg.display().to_string(), message: format!("{e} (and no chat_template.jinja beside it)") })?;
            let v: Value = serde_json::from_str(&text).map_err(|e| ChatError::File { path: cfg.display().to_string(), message: e.to_string() })?;
            v.get("chat_template")
                .and_then(|t| t.as_str())
                .ok_or_else(|| ChatError::File { path: cfg.display().to_string(), message: "no string `chat_template` field".into() })?
                .to_string()
        };
        Self::new(&tok, template)
    }

    /// The tokenizer's special tokens (`added_tokens` marked `special`), longest first: text
    /// that contains one would be tokenised as that control token, not as text.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.tokenizer.get_added_tokens_decoder().values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content.clone()).collect();
        v.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        v
    }

    /// From a `tokenizer.json` and the Jinja chat template text.
    pub fn new(tokenizer_json: &Path, template: String) -> Result<Self, ChatError> {
        let tokenizer = Tokenizer::from_file(tokenizer_json)
            .map_err(|e| ChatError::File { path: tokenizer_json.display().to_string(), message: e.to_string() })?;
        Ok(Self { tokenizer, template, image_token: "<|image|>".into() })
    }

    /// The template with `{% generation %}` / `{% endgeneration %}` turned into markers. Each
    /// becomes a block tag (`{% if true %}…{% endif %}`), so `trim_blocks`/`lstrip_blocks` treat
    /// the surrounding whitespace as they treat the original tags.
    fn marked_template(&self) -> String {
        let re = regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("valid regex");
        re.replace_all(&self.template, |c: &regex::Captures| {
            let marker = if c.get(2).is_some() { GEN_END } else { GEN_START };
            format!("{{%{} if true %}}{marker}{{% endif {}%}}", &c[1], &c[3])
        })
        .into_owned()
    }

    /// Render `messages` (HF-style: `role`, `content` as a string or a list of `{type: text|image}`
    /// parts); returns the text and the generation spans (byte ranges) in it.
    pub fn render(&self, messages: &Value, add_generation_prompt: bool) -> Result<(String, Vec<Range<usize>>), ChatError> {
        let source = self.marked_template();
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template("chat", &source).map_err(|e| ChatError::Template(e.to_string()))?;
        let rendered = env
            .get_template("chat")
            .and_then(|t| t.render(minijinja::context! { messages => messages, add_generation_prompt => add_generation_prompt }))
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let mut text = String::with_capacity(rendered.len());
        let mut spans = Vec::new();
        let mut open: Option<usize> = None;
        for ch in rendered.chars() {
            match ch {
                GEN_START => open = Some(text.len()),
                GEN_END => {
                    let start = open.take().ok_or_else(|| ChatError::Template("{% endgeneration %} without {% generation %}".into()))?;
                    spans.push(start..text.len());
                }
                c => text.push(c),
            }
        }
        Ok((text, spans))
    }

    /// Render, expand image placeholders (`image_tokens[k]` copies for the k-th image), tokenise
    /// and label. The number of `<|image|>` in the rendered text must equal the images given.
    pub fn encode(&self, messages: &Value, add_generation_prompt: bool, image_tokens: &[usize]) -> Result<Encoded, ChatError> {
        let (text, spans) = self.render(messages, add_generation_prompt)?;
        // expand placeholders, shifting the spans past each expansion
        let found = text.matches(&self.image_token).count();
        if found != image_tokens.len() {
            return Err(ChatError::Conversation(format!(
                "the rendered conversation has {found} {} placeholders but {} images were given",
                self.image_token,
                image_tokens.len()
            )));
        }
        let mut expanded = String::with_capacity(text.len());
        let mut shifts: Vec<(usize, usize)> = Vec::new(); // (end of placeholder in `text`, bytes gained)
        let mut rest = text.as_str();
        let mut consumed = 0;
        for &n in image_tokens {
            let at = rest.find(&self.image_token).expect("counted above");
            expanded.push_str(&rest[..at]);
            expanded.push_str(&self.image_token.repeat(n));
            let gained = self.image_token.len() * n.saturating_sub(1);
            consumed += at + self.image_token.len();
            shifts.push((consumed, gained));
            rest = &rest[at + self.image_token.len()..];
        }
        expanded.push_str(rest);
        let shift = |pos: usize| -> usize { pos + shifts.iter().filter(|(end, _)| *end <= pos).map(|(_, g)| g).sum::<usize>() };
        let spans: Vec<Range<usize>> = spans.into_iter().map(|r| shift(r.start)..shift(r.end)).collect();

        let enc = self.tokenizer.encode(expanded.as_str(), false).map_err(|e| ChatError::Tokenizer(e.to_string()))?;
        let ids = enc.get_ids().to_vec();
        let labels = enc
            .get_offsets()
            .iter()
            .zip(&ids)
            .map(|(&(s, e), &id)| if spans.iter().any(|r| s < r.end && e > r.start) { id as i64 } else { -100 })
            .collect();
        Ok(Encoded { ids, labels })
    }
}
