//! Incremental detokenisation for streaming: text leaves only in whole UTF-8 characters, and a
//! stop string ends the text without ever appearing in it, not even in part: text that could be
//! the start of a stop string is held back until it is known not to be.

/// Tracks one choice's decoded output and how much of it has been sent.
#[derive(Debug, Default)]
pub struct TextStream {
    stop: Vec<String>,
    sent: usize, // bytes of the decoded output already emitted
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        Self { stop, sent: 0 }
    }

    /// Given the whole decoded output so far, returns the text that may be sent now, and whether
    /// a stop string was reached (the text before it is then all that is left to send).
    pub fn push(&mut self, decoded: &str) -> (String, bool) {
        // Search from where a stop string could begin that was not visible before.
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest);
        while !decoded.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| decoded[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(end) = hit {
            let text = decoded.get(self.sent..end).unwrap_or_default().to_string();
            self.sent = end.max(self.sent);
            return (text, true);
        }
        // A trailing U+FFFD may be a character whose remaining bytes are still to come: wait for
        // the next token. Lossy decoding turns an unfinished suffix (at most 3 bytes) into exactly
        // one U+FFFD and nothing before it can change, so only the last one is held: a model that
        // emits invalid bytes still streams, one character behind.
        let mut end = decoded.strip_suffix('\u{FFFD}').unwrap_or(decoded).len();
        // Hold back the longest tail that is the start of some stop string.
        if let Some(start) = (self.sent..end)
            .filter(|&i| decoded.is_char_boundary(i))
            .find(|&i| self.stop.iter().any(|s| s.starts_with(&decoded[i..end])))
        {
            end = start;
        }
        if end <= self.sent {
            return (String::new(), false);
        }
        let text = decoded[self.sent..end].to_string();
        self.sent = end;
        (text, false)
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
        let mut s = TextStream::new(stop.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for decoded in steps {
            let (text, stopped) = s.push(decoded);
            out.push_str(&text);
            if stopped {
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
    fn held_text_is_not_sent_early() {
        let mut s = TextStream::new(vec!["stop".into()]);
        assert_eq!(s.push("a st"), ("a ".into(), false));
        assert_eq!(s.push("a sto"), (String::new(), false));
        assert_eq!(s.push("a stoX"), ("stoX".into(), false));
    }

    #[test]
    fn cut_characters_wait_for_their_remaining_bytes() {
        // "é" arriving as two byte tokens decodes first to U+FFFD.
        assert_eq!(run(&[], &["caf", "caf\u{FFFD}", "café"]), ("café".into(), false));
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push("caf\u{FFFD}"), ("caf".into(), false));
    }

    #[test]
    fn invalid_bytes_stream_one_character_behind() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push("\u{FFFD}"), (String::new(), false));
        assert_eq!(s.push("\u{FFFD}\u{FFFD}"), ("\u{FFFD}".into(), false));
        assert_eq!(s.push("\u{FFFD}\u{FFFD}\u{FFFD}"), ("\u{FFFD}".into(), false));
        assert_eq!(s.finish("\u{FFFD}\u{FFFD}\u{FFFD}"), "\u{FFFD}");
    }

    #[test]
    fn multibyte_stop_strings_and_text() {
        assert_eq!(run(&["東京"], &["日本の東", "日本の東京です"]), ("日本の".into(), true));
    }
}
