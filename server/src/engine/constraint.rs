//! Structured outputs in the engine: grammars compiled by llguidance (the engine llama.cpp, vLLM,
//! SGLang and mistral.rs use) against the tokenizer's own token bytes ([`Grammars`], with a
//! bounded cache of compiled grammars), and per sequence a [`Constraint`] that masks each step's
//! logits to the tokens its grammar allows and follows the tokens chosen.
//!
//! The mask applies to the raw logits, before every sampling rule (temperature, top-k/p, min-p,
//! `logit_bias`, penalties) and before the log-probabilities are taken, as vLLM applies its
//! grammar bitmask: reported logprobs are those of the constrained distribution.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use gpt::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use prometheus::{IntCounter, IntGauge};

/// A grammar in one of the forms llguidance compiles (validation turns every request form into
/// one of these: a choice and GBNF become Lark).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Grammar {
    /// A JSON schema, as compact JSON text.
    JsonSchema(String),
    /// A regular expression (Rust's `regex` syntax) that the whole output matches.
    Regex(String),
    /// llguidance's Lark dialect.
    Lark(String),
}

impl Grammar {
    fn top_level(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Grammar::JsonSchema(text) => {
                let mut schema = serde_json::from_str(text).map_err(|e| format!("the schema is not JSON: {e}"))?;
                compact_json(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// JSON written with no free whitespace (`{"a": 1, "b": [2, 3]}`, Python's `json.dumps` layout)
/// unless the schema sets llguidance's own options (`x-guidance`): llguidance's default lets a
/// model put any run of whitespace between tokens, which small models fill with newlines (and a
/// chat template's stop string, a blank line, then cuts the object short).
pub fn compact_json(schema: &mut serde_json::Value) {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
}

/// The engine's side of the tokenizer for llguidance: every token's bytes in a trie, and
/// tokenisation by the served tokenizer itself.
struct TokenBytes {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TokenBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s).ok().map(|text| self.tokenizer.encode(text)) {
            Some(Ok(ids)) => ids,
            // Bytes that are not text, or characters outside a character vocabulary.
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// Every token's bytes, `vocab` entries (the model's logits; ids the tokenizer lacks are empty,
/// never allowed), from the tokenizer itself: a character vocabulary's tokens are their
/// characters' UTF-8; a byte-level BPE's (GPT-2's) are read by llguidance's reader of
/// `tokenizer.json`, which maps its byte alphabet back to bytes and marks special tokens. (The
/// `toktrie_hf_tokenizers` adapter would do the same, but pins another major version of
/// `tokenizers`, compiled twice then.)
fn token_bytes(tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, String> {
    let mut bytes = if tokenizer.is_char_level() {
        (0..vocab as u32)
            .map(|id| {
                tokenizer
                    .inner()
                    .id_to_token(id)
                    .map(String::into_bytes)
                    .unwrap_or_default()
            })
            .collect()
    } else {
        let json: serde_json::Value = serde_json::from_str(
            &tokenizer
                .inner()
                .to_string(false)
                .map_err(|e| format!("the tokenizer could not be written as JSON: {e}"))?,
        )
        .map_err(|e| format!("the tokenizer's JSON does not parse: {e}"))?;
        // Its reader asserts on malformed byte-fallback tokens: a panic is a tokenizer it cannot
        // read, not a server failure.
        std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| "llguidance could not read the tokenizer's vocabulary".to_string())?
            .map_err(|e| format!("structured outputs need a byte-level, byte-fallback or character vocabulary: {e}"))?
    };
    bytes.resize(vocab, Vec::new());
    Ok(bytes)
}

/// Compiled grammars kept for reuse, at most this many (least recently used dropped).
pub const GRAMMAR_CACHE: usize = 64;

/// What compiling a grammar may cost: beyond these llguidance refuses it (limits table).
pub const MAX_GRAMMAR_SYMBOLS: usize = 500_000;
pub const MAX_LEXER_FUEL: u64 = 1_000_000;

/// The grammars of one served tokenizer: llguidance's factory over its token bytes, and the
/// compiled grammars cached.
pub struct Grammars {
    factory: Result<ParserFactory, String>,
    /// Entries of the logits; the trie may have one more (an end token a vocabulary lacks).
    vocab: usize,
    eos: Option<u32>,
    cache: Mutex<VecDeque<(Grammar, Arc<Compiled>)>>,
    /// For `/metrics` ([`Grammars::collectors`]): compilations, cache hits, grammars cached.
    compiled: IntCounter,
    hits: IntCounter,
    entries: IntGauge,
}

/// A compiled grammar, from which each sequence starts its own [`Constraint`].
pub struct Compiled {
    parser: TokenParser,
    vocab: usize,
    eos: Option<u32>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").field("vocab", &self.vocab).finish()
    }
}

impl Grammars {
    /// For `tokenizer` and a model with `vocab` logits. A vocabulary llguidance cannot read
    /// makes every constrained request an error that says why, not a failed start.
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Self {
        let eos = tokenizer.eos_token_id().filter(|&id| (id as usize) < vocab);
        let factory = token_bytes(tokenizer, vocab).and_then(|mut words| {
            // llguidance needs an end token; a vocabulary without one (a character vocabulary)
            // gets one past the logits, which the model never samples: such a grammar ends where
            // nothing else may follow.
            let tok_eos = match eos {
                Some(id) => id,
                None => {
                    words.push(b"\xFF<|end|>".to_vec());
                    vocab as u32
                }
            };
            let info = TokRxInfo::new(words.len() as u32, tok_eos);
            let env: TokEnv = Arc::new(TokenBytes {
                trie: TokTrie::from(&info, &words),
                tokenizer: tokenizer.clone(),
            });
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            let limits = factory.limits_mut();
            limits.max_grammar_size = MAX_GRAMMAR_SYMBOLS;
            limits.initial_lexer_fuel = MAX_LEXER_FUEL;
            limits.verbose_errors = false;
            Ok(factory)
        });
        if let Err(e) = &factory {
            tracing::warn!(error = %e, "structured outputs are unavailable with this tokenizer");
        }
        Self {
            factory,
            vocab,
            eos,
            cache: Mutex::new(VecDeque::new()),
            compiled: IntCounter::new("gpt_grammar_compilations_total", "Structured-output grammars compiled")
                .expect("a valid metric name"),
            hits: IntCounter::new(
                "gpt_grammar_cache_hits_total",
                "Structured-output grammars taken from the cache of compiled grammars",
            )
            .expect("a valid metric name"),
            entries: IntGauge::new("gpt_grammar_cache_entries", "Compiled grammars in the cache")
                .expect("a valid metric name"),
        }
    }

    /// The counters for `/metrics`.
    pub fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.compiled.clone()),
            Box::new(self.hits.clone()),
            Box::new(self.entries.clone()),
        ]
    }

    /// Compiled grammars held now.
    pub fn cached(&self) -> usize {
        self.cache.lock().map_or(0, |c| c.len())
    }

    /// Whether the vocabulary has an end-of-text token (beam search needs one to end a beam
    /// whose grammar is complete).
    pub fn has_end_token(&self) -> bool {
        self.eos.is_some()
    }

    /// `grammar` compiled (or from the cache), or why it cannot be: invalid, beyond the limits,
    /// or allowing no first token of this vocabulary.
    pub fn compile(&self, grammar: &Grammar) -> Result<Arc<Compiled>, String> {
        let factory = self.factory.as_ref().map_err(Clone::clone)?;
        if let Ok(mut cache) = self.cache.lock() {
            if let Some(at) = cache.iter().position(|(g, _)| g == grammar) {
                let entry = cache.remove(at).expect("position is in range");
                let compiled = entry.1.clone();
                cache.push_back(entry);
                self.hits.inc();
                return Ok(compiled);
            }
        }
        let top = grammar.top_level()?;
        // (A panic in the compiler is a grammar it cannot take, not a server failure.)
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory.create_parser(top)))
            .map_err(|_| "llguidance failed on this grammar".to_string())?
            .map_err(|e| e.to_string())?;
        let compiled = Arc::new(Compiled {
            parser,
            vocab: self.vocab,
            eos: self.eos,
        });
        // A grammar whose first step allows no token of this vocabulary (a JSON schema with a
        // character vocabulary that has no `{`) would produce nothing: refused now.
        // (llguidance reports a mask with no token as an error; and where the grammar forces
        // bytes that no token holds, its mask may list tokens that it then refuses: each listed
        // token is tried, up to a few.)
        let mut first = compiled.start();
        let allowed = first.allowed().unwrap_or_default();
        let starts = allowed.iter().take(64).any(|&t| first.accepts(t));
        if !starts && !first.may_end().unwrap_or(false) {
            return Err(
                "it allows no token of this model's vocabulary to start with (the vocabulary lacks the characters \
                 it needs)"
                    .into(),
            );
        }
        self.compiled.inc();
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= GRAMMAR_CACHE {
                cache.pop_front();
            }
            cache.push_back((grammar.clone(), compiled.clone()));
            self.entries.set(cache.len() as i64);
        }
        Ok(compiled)
    }
}

impl Compiled {
    /// A fresh constraint at the start of the output.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: Matcher::new(Ok(self.parser.deep_clone())),
            vocab: self.vocab,
            eos: self.eos,
            mask: None,
        }
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    eos: Option<u32>,
    /// The next step's allowed tokens, once computed.
    mask: Option<SimpleVob>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("vocab", &self.vocab).finish()
    }
}

impl Clone for Constraint {
    /// An independent copy (a fork of the sequence, a beam).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
            eos: self.eos,
            mask: self.mask.clone(),
        }
    }
}

impl Constraint {
    /// Computes the next step's mask (the costly part, ~50-500 µs for GPT-2's vocabulary); the
    /// engine runs it while the model computes the step.
    pub fn prepare(&mut self) -> Result<(), String> {
        if self.mask.is_none() {
            self.mask = Some(self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    /// The tokens of the model's vocabulary allowed next (the end-of-text token included where
    /// the grammar may end).
    pub fn allowed(&mut self) -> Result<Vec<u32>, String> {
        self.prepare()?;
        let mut out = Vec::new();
        if let Some(mask) = &self.mask {
            mask.iter_set_entries(|i| {
                if i < self.vocab {
                    out.push(i as u32)
                }
            });
        }
        Ok(out)
    }

    /// Whether the output may end here.
    pub fn may_end(&mut self) -> Result<bool, String> {
        if let Some(e) = self.matcher.get_error() {
            return Err(e);
        }
        Ok(self.matcher.is_stopped() || self.matcher.is_accepting().map_err(|e| e.to_string())?)
    }

    /// Sets every logit the grammar does not allow next to -inf. Returns how many are left.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<usize, String> {
        self.prepare()?;
        let Some(mask) = &self.mask else { return Ok(0) };
        let n = logits.len().min(self.vocab);
        let mut left = n;
        mask.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
                left -= 1;
            }
        });
        Ok(left)
    }

    /// Whether the grammar takes `token` next (the end-of-text token where it may end here).
    /// The mask says so too, except where the grammar forces bytes that no token of the
    /// vocabulary holds: then the mask may list a token the grammar refuses, a dead end.
    pub fn accepts(&mut self, token: u32) -> bool {
        if Some(token) == self.eos {
            return self.may_end().unwrap_or(false);
        }
        self.matcher.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    /// Follows the token chosen (not the end-of-text token: that ends the sequence).
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        self.mask = None;
        if Some(token) == self.eos {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// The grammar is complete and allows nothing more: the output ends here.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

/// Runs `step` (the model's forward pass) while another thread computes each constraint's next
/// mask: the masks depend only on the tokens so far. (An error there shows again when the
/// sequence masks its logits.)
pub fn prepare_while<T>(constraints: Vec<&mut Constraint>, step: impl FnOnce() -> T) -> T {
    if constraints.is_empty() {
        return step();
    }
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for c in constraints {
                let _ = c.prepare();
            }
        });
        step()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn char_tokenizer(text: &str) -> anyhow::Result<Tokenizer> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("corpus.txt");
        std::fs::write(&path, text)?;
        Ok(Tokenizer::train_char(&[path])?)
    }

    /// Greedy "generation" that always takes the lowest allowed id: what the grammar permits.
    fn walk(c: &mut Constraint, eos: Option<u32>, steps: usize) -> anyhow::Result<Vec<u32>> {
        let mut out = Vec::new();
        for _ in 0..steps {
            if c.is_finished() {
                break;
            }
            let allowed = c.allowed().map_err(anyhow::Error::msg)?;
            let Some(&t) = allowed.iter().find(|&&t| Some(t) != eos).or(allowed.first()) else {
                break;
            };
            if Some(t) == eos {
                break;
            }
            c.commit(t).map_err(anyhow::Error::msg)?;
            out.push(t);
        }
        Ok(out)
    }

    #[test]
    fn a_regex_over_a_character_vocabulary_masks_and_ends() -> anyhow::Result<()> {
        let tok = char_tokenizer("abc xyz 0123456789")?;
        let grammars = Grammars::new(&tok, tok.vocab_size());
        let compiled = grammars
            .compile(&Grammar::Regex("[0-9]{3}".into()))
            .map_err(anyhow::Error::msg)?;
        let mut c = compiled.start();
        let mut logits = vec![0.0f32; tok.vocab_size()];
        let left = c.mask(&mut logits).map_err(anyhow::Error::msg)?;
        assert_eq!(left, 10, "only the ten digits may start it");
        for (id, v) in logits.iter().enumerate() {
            let ch = tok.decode(&[id as u32])?;
            assert_eq!(v.is_finite(), ch.chars().all(|c| c.is_ascii_digit()), "{ch:?}");
        }
        let out = walk(&mut c, None, 10)?;
        assert_eq!(tok.decode(&out)?, "000");
        assert!(c.is_finished(), "three digits complete the regex");
        Ok(())
    }

    #[test]
    fn the_cache_returns_the_same_compiled_grammar() -> anyhow::Result<()> {
        let tok = char_tokenizer("ab")?;
        let grammars = Grammars::new(&tok, tok.vocab_size());
        let a = grammars
            .compile(&Grammar::Regex("a+".into()))
            .map_err(anyhow::Error::msg)?;
        let b = grammars
            .compile(&Grammar::Regex("a+".into()))
            .map_err(anyhow::Error::msg)?;
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(grammars.hits.get(), 1);
        assert_eq!(grammars.compiled.get(), 1);
        assert_eq!(grammars.cached(), 1);
        Ok(())
    }

    #[test]
    fn a_grammar_the_vocabulary_cannot_start_is_refused() -> anyhow::Result<()> {
        let tok = char_tokenizer("abc")?;
        let grammars = Grammars::new(&tok, tok.vocab_size());
        let err = match grammars.compile(&Grammar::JsonSchema(r#"{"type":"object"}"#.into())) {
            Err(e) => e,
            Ok(_) => anyhow::bail!("a JSON object needs `{{`, which the vocabulary lacks"),
        };
        assert!(err.contains("vocabulary"), "{err}");
        let err = match grammars.compile(&Grammar::Regex("(".into())) {
            Err(e) => e,
            Ok(_) => anyhow::bail!("an unclosed group is not a regex"),
        };
        assert!(!err.is_empty());
        Ok(())
    }

    #[test]
    fn json_over_a_byte_level_vocabulary_walks_to_valid_json() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("corpus.txt");
        std::fs::write(&path, r#"{"name": "Romeo", "age": 16, "tags": ["a", "b"]} "#.repeat(50))?;
        let tok = Tokenizer::train_bpe(&[path], 300)?;
        let grammars = Grammars::new(&tok, tok.vocab_size());
        let schema = r#"{"type":"object","properties":{"age":{"type":"integer","minimum":0,"maximum":99}},"required":["age"],"additionalProperties":false}"#;
        let compiled = grammars
            .compile(&Grammar::JsonSchema(schema.into()))
            .map_err(anyhow::Error::msg)?;
        let mut c = compiled.start();
        let out = walk(&mut c, tok.eos_token_id(), 64)?;
        let text = tok.decode(&out)?;
        let value: serde_json::Value = serde_json::from_str(&text)?;
        assert!(value["age"].is_u64(), "{text}");
        assert!(c.may_end().map_err(anyhow::Error::msg)?);
        Ok(())
    }
}
