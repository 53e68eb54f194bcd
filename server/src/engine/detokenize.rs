//! From generated tokens to the text a client may see. [`Detokenizer`] turns tokens into text as
//! they come, decoding each token once; [`TextStream`] holds back what could be the start of a
//! stop string, so that a stop string ends the text without ever appearing in it, not even in
//! part.

use gpt::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';

/// Incremental detokenisation in the manner of candle-examples' `TokenOutputStream` and vLLM's
/// detokenizer: each new token decodes only a short window of recent tokens (the window starts
/// one token-group back, so that decoders that treat a first token specially, or merge bytes,
/// see some context), and the text the window adds beyond what was already sent is new.
///
/// A window that ends in U+FFFD may end in a character whose remaining bytes are still to come
/// (lossy decoding turns an unfinished UTF-8 suffix into exactly one U+FFFD, and nothing before it
/// can change): that one character is held and the window grows until it is complete. Everything
/// before it is sent, so a model that emits invalid bytes still streams, one character behind.
/// Special tokens (`<|endoftext|>`) add no text unless it is made with `skip_special: false`.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    keep_special: bool,
    tokens: Vec<u32>,
    /// The window is `tokens[prefix..]`; `tokens[prefix..read]` were sent with earlier windows.
    prefix: usize,
    read: usize,
    /// Bytes of `decode(tokens[prefix..read])`.
    base: usize,
    /// Bytes of the current window sent beyond `base` (while a character is held).
    extra: usize,
}

impl Detokenizer {
    pub fn new(skip_special: bool) -> Self {
        Self {
            keep_special: !skip_special,
            ..Self::default()
        }
    }

    fn decode(&self, tokenizer: &Tokenizer, ids: &[u32]) -> gpt::Result<String> {
        match self.keep_special {
            true => tokenizer.decode(ids),
            false => tokenizer.decode_skip_special(ids),
        }
    }

    /// The text `token` adds (possibly empty).
    pub fn push(&mut self, token: u32, tokenizer: &Tokenizer) -> gpt::Result<String> {
        self.tokens.push(token);
        let window = self.decode(tokenizer, &self.tokens[self.prefix..])?;
        let sent = self.base + self.extra;
        if window.len() < sent || !window.is_char_boundary(sent) {
            return Ok(String::new()); // the decoder changed earlier text: wait for more tokens
        }
        let held = window.ends_with(REPLACEMENT);
        let end = if held {
            window.len() - REPLACEMENT.len_utf8()
        } else {
            window.len()
        };
        let new = window.get(sent..end).unwrap_or_default().to_string();
        if held {
            self.extra += new.len();
        } else {
            self.prefix = self.read;
            self.read = self.tokens.len();
            self.base = self.decode(tokenizer, &self.tokens[self.prefix..self.read])?.len();
            self.extra = 0;
        }
        Ok(new)
    }

    /// At the end of generation: the held character, if any (it stays U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> gpt::Result<String> {
        let window = self.decode(tokenizer, &self.tokens[self.prefix..])?;
        let rest = window.get(self.base + self.extra..).unwrap_or_default().to_string();
        self.extra += rest.len();
        Ok(rest)
    }
}

/// Tracks one choice's decoded output and how much of it has been sent.
#[derive(Debug, Default)]
pub struct TextStream {
    stop: Vec<String>,
    /// The stop string that ends the text stays in it (vLLM's `include_stop_str_in_output`).
    include_stop: bool,
    sent: usize, // bytes of the decoded output already emitted
}

impl TextStream {
    pub fn new(stop: Vec<String>, include_stop: bool) -> Self {
        Self {
            stop,
            include_stop,
            sent: 0,
        }
    }

    /// Given the whole decoded output so far, returns the text that may be sent now, and the
    /// stop string reached, if one was (the text before it, or up to its end with
    /// `include_stop`, is then all that is left to send). With `check_stop` false (before
    /// `min_tokens`), stop strings neither stop nor hold text back.
    pub fn push(&mut self, decoded: &str, check_stop: bool) -> (String, Option<String>) {
        if !check_stop {
            let text = decoded.get(self.sent..).unwrap_or_default().to_string();
            self.sent = decoded.len();
            return (text, None);
        }
        // Search from where a stop string could begin that was not visible before.
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest);
        while !decoded.is_char_boundary(from) {
            from -= 1;
        }
        // Only a stop string that ends in unsent text counts (one sent before `min_tokens` does
        // not stop the text later).
        // The earliest; of those starting there, the longest.
        let hit = self
            .stop
            .iter()
            .filter_map(|s| {
                decoded[from..]
                    .match_indices(s.as_str())
                    .map(|(i, _)| from + i)
                    .find(|&i| i + s.len() > self.sent)
                    .map(|i| (i, std::cmp::Reverse(s.len()), s))
            })
            .min();
        if let Some((start, _, stop)) = hit {
            let end = if self.include_stop { start + stop.len() } else { start };
            let text = decoded.get(self.sent..end).unwrap_or_default().to_string();
            self.sent = end.max(self.sent);
            return (text, Some(stop.clone()));
        }
        // Hold back the longest tail that is the start of some stop string.
        let mut end = decoded.len();
        if let Some(start) = (self.sent..end)
            .filter(|&i| decoded.is_char_boundary(i))
            .find(|&i| self.stop.iter().any(|s| s.starts_with(&decoded[i..end])))
        {
            end = start;
        }
        if end <= self.sent {
            return (String::new(), None);
        }
        let text = decoded[self.sent..end].to_string();
        self.sent = end;
        (text, None)
    }

    /// At the end of generation: whatever is still held back (no stop string followed).
    pub fn finish(&mut self, decoded: &str) -> String {
        let text = decoded.get(self.sent..).unwrap_or_default().to_string();
        self.sent = decoded.len();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds growing prefixes, as token-by-token decoding does, and collects what is sent.
    fn run(stop: &[&str], steps: &[&str]) -> (String, bool) {
        run_with(stop, steps, false)
    }

    fn run_with(stop: &[&str], steps: &[&str], include_stop: bool) -> (String, bool) {
        let mut s = TextStream::new(stop.iter().map(|s| s.to_string()).collect(), include_stop);
        let mut out = String::new();
        for decoded in steps {
            let (text, stopped) = s.push(decoded, true);
            out.push_str(&text);
            if stopped.is_some() {
                return (out, true);
            }
        }
        out.push_str(&s.finish(steps.last().copied().unwrap_or_default()));
        (out, false)
    }

    #[test]
    fn stop_string_never_appears_even_split_across_tokens() {
        assert_eq!(
            run(&["\n\n"], &["Hello", "Hello\n", "Hello\n\n", "Hello\n\nWorld"]),
            ("Hello".into(), true)
        );
        assert_eq!(run(&["END"], &["abcE", "abcEN", "abcEND"]), ("abc".into(), true));
        // A partial match that does not complete is sent after all.
        assert_eq!(run(&["END"], &["abcE", "abcEx"]), ("abcEx".into(), false));
    }

    #[test]
    fn with_include_stop_the_stop_string_ends_the_text() {
        assert_eq!(
            run_with(&["\n\n"], &["Hello", "Hello\n", "Hello\n\nWorld"], true),
            ("Hello\n\n".into(), true)
        );
        // Of two stop strings starting at one place, the longer one is the one reached.
        let mut s = TextStream::new(vec!["ab".into(), "abc".into()], true);
        assert_eq!(s.push("xabcd", true), ("xabc".into(), Some("abc".into())));
    }

    #[test]
    fn held_text_is_not_sent_early() {
        let mut s = TextStream::new(vec!["stop".into()], false);
        assert_eq!(s.push("a st", true), ("a ".into(), None));
        assert_eq!(s.push("a sto", true), (String::new(), None));
        assert_eq!(s.push("a stoX", true), ("stoX".into(), None));
    }

    #[test]
    fn stop_strings_are_ignored_until_checked() {
        let mut s = TextStream::new(vec!["b".into()], false);
        assert_eq!(s.push("ab", false), ("ab".into(), None));
        assert_eq!(s.push("abcb", true), ("c".into(), Some("b".into())));
    }

    #[test]
    fn multibyte_stop_strings_and_text() {
        assert_eq!(run(&["東京"], &["日本の東", "日本の東京です"]), ("日本の".into(), true));
    }

    fn tokenizer() -> Tokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2/tokenizer.json");
        Tokenizer::from_file(&path).expect("fixture tokenizer")
    }

    /// The byte-level token of one byte. GPT-2's byte-to-character table maps bytes 0xAE..=0xFF
    /// (and the printable ASCII) to the character of the same code point.
    fn byte_token(tok: &Tokenizer, byte: u8) -> u32 {
        tok.inner()
            .token_to_id(&char::from(byte).to_string())
            .expect("byte token")
    }

    fn detokenize(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
        let mut d = Detokenizer::default();
        let mut out: Vec<String> = ids.iter().map(|&id| d.push(id, tok).expect("push")).collect();
        out.push(d.finish(tok).expect("finish"));
        out
    }

    #[test]
    fn detokenizing_token_by_token_gives_the_whole_decoding() {
        let tok = tokenizer();
        let text = "First Citizen:\nBefore we proceed, unicode: café 東京 and a word never seen: zyzzyva!";
        let ids = tok.encode(text).expect("encode");
        assert!(ids.len() > 20);
        let pieces = detokenize(&tok, &ids);
        assert_eq!(pieces.concat(), text);
        assert!(
            pieces.iter().filter(|p| !p.is_empty()).count() > 10,
            "streams piece by piece"
        );
        // The end-of-text token adds nothing.
        let eot = tok.eos_token_id().expect("eot");
        assert_eq!(
            detokenize(&tok, &[ids[0], eot, ids[1]]).concat(),
            tok.decode(&ids[..2]).expect("decode")
        );
    }

    #[test]
    fn cut_characters_wait_for_their_remaining_bytes() {
        let tok = tokenizer();
        // "é" is 0xC3 0xA9: as two byte tokens, nothing is sent until the second.
        let (c3, a9) = (byte_token(&tok, 0xC3), byte_token(&tok, 0xA9));
        let caf = tok.encode("caf").expect("encode");
        let mut ids = caf.clone();
        ids.extend([c3, a9]);
        let pieces = detokenize(&tok, &ids);
        assert_eq!(pieces.concat(), "café");
        assert_eq!(pieces[caf.len()], "", "the first byte of é is held");
        assert_eq!(pieces[caf.len() + 1], "é");
    }

    #[test]
    fn invalid_bytes_stream_one_character_behind() {
        let tok = tokenizer();
        let ff = byte_token(&tok, 0xFF);
        let pieces = detokenize(&tok, &[ff, ff, ff]);
        assert_eq!(pieces, ["", "\u{FFFD}", "\u{FFFD}", "\u{FFFD}"]);
    }
}
