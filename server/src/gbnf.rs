//! llama.cpp's GBNF grammars (its server's `grammar` field) rewritten in llguidance's Lark dialect,
//! which the engine compiles. llguidance ships this conversion only as a Python script
//! (`gbnf_to_lark.py`), so it is written here: a parser that follows llama.cpp's
//! `grammar-parser.cpp` (rules `name ::= ...`, a newline ends a rule outside parentheses, `#`
//! comments, literals and character classes with `\x`, `\u`, `\U` escapes, `.`, groups,
//! `* + ? {m} {m,} {m,n}`), and an emitter that writes each rule on one Lark line.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq)]
enum Atom {
    Literal(String),
    /// A character class: negated, and its ranges (single characters as `(c, c)`).
    Class(bool, Vec<(char, char)>),
    Any,
    Rule(String),
    Group(Vec<Vec<Item>>),
}

#[derive(Debug, Clone, PartialEq)]
struct Item {
    atom: Atom,
    /// Repetitions allowed: `(min, max)`, `None` for no upper bound.
    repeat: (u32, Option<u32>),
}

struct Parser<'a> {
    src: &'a [u8],
    text: &'a str,
    pos: usize,
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

impl<'a> Parser<'a> {
    fn error<T>(&self, what: &str) -> Result<T, String> {
        let line = self.text[..self.pos.min(self.text.len())].matches('\n').count() + 1;
        Err(format!("GBNF, line {line}: {what}"))
    }

    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    /// Spaces, tabs and comments; newlines too where `newlines` (inside parentheses, after
    /// `::=` and `|`).
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.pos += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.pos += 1;
                    }
                }
                b'\r' | b'\n' if newlines => self.pos += 1,
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, String> {
        let start = self.pos;
        while self.peek().is_some_and(is_word) {
            self.pos += 1;
        }
        if start == self.pos {
            return self.error("expected a rule name");
        }
        Ok(self.text[start..self.pos].to_string())
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char, String> {
        let rest = &self.text[self.pos..];
        let Some(c) = rest.chars().next() else {
            return self.error("unexpected end of the grammar");
        };
        self.pos += c.len_utf8();
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.text[self.pos..].chars().next() else {
            return self.error("unexpected end after `\\`");
        };
        self.pos += e.len_utf8();
        let hex = |p: &mut Self, digits: usize| -> Result<char, String> {
            let code = p
                .text
                .get(p.pos..p.pos + digits)
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .and_then(char::from_u32);
            match code {
                Some(ch) => {
                    p.pos += digits;
                    Ok(ch)
                }
                None => p.error(&format!("`\\{e}` needs {digits} hex digits of a character")),
            }
        };
        match e {
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            't' => Ok('\t'),
            'r' => Ok('\r'),
            'n' => Ok('\n'),
            '\\' | '"' | '[' | ']' | '-' | '^' => Ok(e),
            _ => self.error(&format!("unknown escape `\\{e}`")),
        }
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Item>>, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some(b'|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>, String> {
        let mut items: Vec<Item> = Vec::new();
        loop {
            let atom = match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    let mut s = String::new();
                    while self.peek() != Some(b'"') {
                        if self.peek().is_none() {
                            return self.error("unterminated literal");
                        }
                        s.push(self.char()?);
                    }
                    self.pos += 1;
                    Atom::Literal(s)
                }
                Some(b'[') => {
                    self.pos += 1;
                    let negated = self.peek() == Some(b'^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != Some(b']') {
                        if self.peek().is_none() {
                            return self.error("unterminated character class");
                        }
                        let lo = self.char()?;
                        let hi = if self.peek() == Some(b'-') && self.src.get(self.pos + 1) != Some(&b']') {
                            self.pos += 1;
                            self.char()?
                        } else {
                            lo
                        };
                        if hi < lo {
                            return self.error(&format!("the range {lo:?}-{hi:?} is empty"));
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    Atom::Class(negated, ranges)
                }
                Some(b'.') => {
                    self.pos += 1;
                    Atom::Any
                }
                Some(b'(') => {
                    self.pos += 1;
                    self.space(true);
                    let alts = self.alternates(true)?;
                    if self.peek() != Some(b')') {
                        return self.error("expected `)`");
                    }
                    self.pos += 1;
                    Atom::Group(alts)
                }
                Some(b'<') => return self.error("token references (`<...>`) are not supported"),
                Some(c) if is_word(c) => {
                    // A name followed by `::=` starts the next rule (a rule may end without a
                    // newline only at the end of the text, so this is an error in llama.cpp too).
                    Atom::Rule(self.name()?)
                }
                _ => break,
            };
            self.space(nested);
            let repeat = match self.peek() {
                Some(b'*') => (0, None),
                Some(b'+') => (1, None),
                Some(b'?') => (0, Some(1)),
                Some(b'{') => {
                    self.pos += 1;
                    self.space(nested);
                    let number = |p: &mut Self| -> Result<Option<u32>, String> {
                        let start = p.pos;
                        while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                            p.pos += 1;
                        }
                        if start == p.pos {
                            return Ok(None);
                        }
                        match p.text[start..p.pos].parse() {
                            Ok(n) => Ok(Some(n)),
                            Err(_) => p.error("a repetition count is too large"),
                        }
                    };
                    let Some(min) = number(self)? else {
                        return self.error("expected a number after `{`");
                    };
                    self.space(nested);
                    let max = if self.peek() == Some(b',') {
                        self.pos += 1;
                        self.space(nested);
                        number(self)?
                    } else {
                        Some(min)
                    };
                    self.space(nested);
                    if self.peek() != Some(b'}') {
                        return self.error("expected `}`");
                    }
                    if max.is_some_and(|m| m < min) {
                        return self.error(&format!("{{{min},{}}} allows no count", max.unwrap_or(0)));
                    }
                    (min, max)
                }
                _ => {
                    items.push(Item {
                        atom,
                        repeat: (1, Some(1)),
                    });
                    continue;
                }
            };
            self.pos += 1;
            self.space(nested);
            items.push(Item { atom, repeat });
        }
        Ok(items)
    }
}

/// A GBNF name as a Lark rule name: Lark's are lower case (upper case names are terminals), so
/// `-` becomes `__` and an upper-case letter `_` and the letter (GBNF names have no `_`, so no
/// two names meet), behind a prefix that keeps Lark's own words out.
fn lark_name(name: &str) -> String {
    let mut out = String::from("g_");
    for c in name.chars() {
        match c {
            '-' => out.push_str("__"),
            c if c.is_ascii_uppercase() => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            c => out.push(c),
        }
    }
    out
}

fn class_char(out: &mut String, c: char) {
    let _ = write!(out, "\\x{{{:X}}}", c as u32);
}

fn emit_alternates(
    out: &mut String,
    alts: &[Vec<Item>],
    rules: &BTreeMap<String, Vec<Vec<Item>>>,
) -> Result<(), String> {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        let kept: Vec<&Item> = seq.iter().filter(|item| item.repeat.1 != Some(0)).collect();
        if kept.is_empty() {
            out.push_str("\"\"");
        }
        for (j, item) in kept.into_iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            match &item.atom {
                Atom::Literal(s) if s.is_empty() => out.push_str("\"\""),
                Atom::Literal(s) => out.push_str(&serde_json::to_string(s).map_err(|e| e.to_string())?),
                Atom::Class(negated, ranges) => {
                    out.push_str("/[");
                    if *negated {
                        out.push('^');
                    }
                    for &(lo, hi) in ranges {
                        class_char(out, lo);
                        if hi != lo {
                            out.push('-');
                            class_char(out, hi);
                        }
                    }
                    out.push_str("]/");
                }
                Atom::Any => out.push_str("/(?s:.)/"),
                Atom::Rule(name) => {
                    if !rules.contains_key(name) {
                        return Err(format!("GBNF: the rule `{name}` is used but not defined"));
                    }
                    out.push_str(&lark_name(name));
                }
                Atom::Group(inner) => {
                    out.push('(');
                    emit_alternates(out, inner, rules)?;
                    out.push(')');
                }
            }
            match item.repeat {
                (1, Some(1)) => {}
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (min, None) => {
                    let _ = write!(out, "{{{min},}}");
                }
                (min, Some(max)) if min == max => {
                    let _ = write!(out, "{{{min}}}");
                }
                (min, Some(max)) => {
                    let _ = write!(out, "{{{min},{max}}}");
                }
            }
        }
    }
    Ok(())
}

/// `gbnf` as a Lark grammar whose start is its `root` rule, or what is wrong with it.
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let mut p = Parser {
        src: gbnf.as_bytes(),
        text: gbnf,
        pos: 0,
    };
    let mut rules: BTreeMap<String, Vec<Vec<Item>>> = BTreeMap::new();
    let mut order = Vec::new();
    loop {
        p.space(true);
        if p.peek().is_none() {
            break;
        }
        let name = p.name()?;
        p.space(false);
        if !p.text[p.pos..].starts_with("::=") {
            return p.error(&format!("expected `::=` after `{name}`"));
        }
        p.pos += 3;
        p.space(true);
        let alts = p.alternates(false)?;
        match p.peek() {
            None | Some(b'\n') | Some(b'\r') => {}
            Some(c) => return p.error(&format!("unexpected `{}`", c as char)),
        }
        if rules.insert(name.clone(), alts).is_some() {
            return p.error(&format!("the rule `{name}` is defined twice"));
        }
        order.push(name);
    }
    if !rules.contains_key("root") {
        return Err("GBNF: the grammar has no `root` rule".into());
    }
    let mut out = String::from("start: g_root\n");
    for name in &order {
        out.push_str(&lark_name(name));
        out.push_str(": ");
        emit_alternates(&mut out, &rules[name], &rules)?;
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_style_rules_become_one_lark_line_each() -> Result<(), String> {
        let gbnf = r#"
# a comment
root   ::= answer ws ("," ws answer)*   # trailing comment
answer ::= "yes" | "no" | [0-9]{1,3}
ws ::= [ \t\n]*
"#;
        let lark = to_lark(gbnf)?;
        assert_eq!(
            lark,
            "start: g_root\n\
             g_root: g_answer g_ws (\",\" g_ws g_answer)*\n\
             g_answer: \"yes\" | \"no\" | /[\\x{30}-\\x{39}]/{1,3}\n\
             g_ws: /[\\x{20}\\x{9}\\x{A}]/*\n"
        );
        Ok(())
    }

    #[test]
    fn continuation_lines_escapes_and_names() -> Result<(), String> {
        let gbnf = "root ::=\n  My-Rule \"\\x41\\u00e9\\\"\" [^\"\\\\]\nMy-Rule ::= ( \"a\"\n | \"b\" ) .";
        let lark = to_lark(gbnf)?;
        assert!(
            lark.contains("g_root: g__my___rule \"Aé\\\"\" /[^\\x{22}\\x{5C}]/"),
            "{lark}"
        );
        assert!(lark.contains("g__my___rule: (\"a\" | \"b\") /(?s:.)/"), "{lark}");
        Ok(())
    }

    #[test]
    fn errors_name_the_line_and_the_problem() {
        let err = |g: &str| to_lark(g).err().unwrap_or_default();
        assert!(err("root ::= missing").contains("`missing` is used but not defined"));
        assert!(err("start ::= \"a\"").contains("no `root` rule"));
        assert!(err("root ::= \"a\nb").contains("unterminated literal"));
        assert!(err("root ::= \"a\"\nroot ::= \"b\"").contains("defined twice"));
        assert!(err("root ::= \"a\"\nx = \"b\"").contains("line 2: expected `::=`"));
        assert!(err("root ::= [z-a]").contains("empty"));
        assert!(err("root ::= \"\\q\"").contains("unknown escape"));
        assert!(err("root ::= \"a\"{3,1}").contains("allows no count"));
    }
}
