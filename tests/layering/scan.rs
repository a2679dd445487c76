//! Reading Rust source for the top-level modules it names: a small lexer that drops
//! comments and literals, and the `crate::`, `self::` and `super::` paths among its
//! tokens, resolved against the file's own module path.

/// One token: an identifier (keywords included), `::`, or another punctuation character.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// A token and its line (1-based).
#[derive(Clone, Debug)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The tokens of `src`, without comments (doc comments included), string, char and
/// number literals, and lifetimes.
pub fn lex(src: &str) -> Vec<Token> {
    let s: Vec<char> = src.chars().collect();
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    // Skips s[from..to], counting its newlines.
    let skip = |from: usize, to: usize, line: &mut usize| {
        *line += s[from..to.min(s.len())]
            .iter()
            .filter(|&&c| c == '\n')
            .count();
        to
    };
    while i < s.len() {
        let c = s[i];
        if c == '/' && at(i + 1) == '/' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let (start, mut depth) = (i, 0);
            while i < s.len() {
                if s[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            i = skip(start, i, &mut line);
        } else if c == '"' {
            i = skip(i, string_end(&s, i + 1), &mut line);
        } else if c == '\'' {
            i = if at(i + 1) == '\\' {
                // An escaped char: '\n', '\'', '\u{..}'.
                let mut j = i + 3;
                while j < s.len() && s[j] != '\'' {
                    j += 1;
                }
                j + 1
            } else if at(i + 2) == '\'' {
                i + 3
            } else {
                // A lifetime or a label.
                let mut j = i + 1;
                while j < s.len() && is_ident_char(s[j]) {
                    j += 1;
                }
                j
            };
        } else if c.is_ascii_digit() {
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
        } else if is_ident_char(c) {
            let start = i;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            match (word.as_str(), at(i)) {
                ("r" | "br" | "cr", '#' | '"') => {
                    let mut j = i;
                    while at(j) == '#' {
                        j += 1;
                    }
                    let hashes = j - i;
                    if at(j) == '"' {
                        i = skip(i, raw_string_end(&s, j + 1, hashes), &mut line);
                    } else if word == "r" && hashes == 1 {
                        // A raw identifier, `r#type`.
                        let start = j;
                        i = j;
                        while i < s.len() && is_ident_char(s[i]) {
                            i += 1;
                        }
                        let tok = Tok::Ident(s[start..i].iter().collect());
                        out.push(Token { tok, line });
                    } else {
                        out.push(Token {
                            tok: Tok::Ident(word),
                            line,
                        });
                    }
                }
                ("b" | "c", '"') => i = skip(i, string_end(&s, i + 1), &mut line),
                // A byte char, `b'x'`: the quote is lexed next.
                ("b", '\'') => {}
                _ => out.push(Token {
                    tok: Tok::Ident(word),
                    line,
                }),
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            if c == '\n' {
                line += 1;
            } else if !c.is_whitespace() {
                out.push(Token {
                    tok: Tok::Punct(c),
                    line,
                });
            }
            i += 1;
        }
    }
    out
}

/// The index after the closing quote of a string whose text starts at `i`.
fn string_end(s: &[char], mut i: usize) -> usize {
    while i < s.len() && s[i] != '"' {
        i += if s[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// The index after the closing `"##..` of a raw string whose text starts at `i`.
fn raw_string_end(s: &[char], mut i: usize, hashes: usize) -> usize {
    while i < s.len() {
        if s[i] == '"' && (1..=hashes).all(|k| s.get(i + k) == Some(&'#')) {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

fn ident(tokens: &[Token], i: usize) -> Option<&str> {
    match tokens.get(i).map(|t| &t.tok) {
        Some(Tok::Ident(w)) => Some(w),
        _ => None,
    }
}

fn is(tokens: &[Token], i: usize, tok: &Tok) -> bool {
    tokens.get(i).map(|t| &t.tok) == Some(tok)
}

/// The names at the crate root that the paths in `tokens` start with, and their lines:
/// `crate::a::..` names `a`, `use crate::{a, b::c}` names `a` and `b`, and `self::` or
/// `super::` paths name the first module below the root that they reach. `module` is the
/// file's module path (`["world", "rank"]` for `world/rank.rs`; empty for the crate
/// root); inline `mod x { .. }` blocks extend it.
pub fn root_names(tokens: &[Token], module: &[String]) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0;
    for i in 0..tokens.len() {
        match &tokens[i].tok {
            Tok::Punct('{') => {
                depth += 1;
                if let (Some("mod"), Some(name)) = (
                    ident(tokens, i.wrapping_sub(2)),
                    ident(tokens, i.wrapping_sub(1)),
                ) {
                    inline.push((depth, name.to_string()));
                }
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(d, _)| *d == depth) {
                    inline.pop();
                }
                depth -= 1;
            }
            Tok::Ident(w) if matches!(w.as_str(), "crate" | "self" | "super") => {
                let starts_path = i == 0 || !is(tokens, i - 1, &Tok::PathSep);
                if starts_path && is(tokens, i + 1, &Tok::PathSep) {
                    let mut here: Vec<String> = module.to_vec();
                    here.extend(inline.iter().map(|(_, n)| n.clone()));
                    path_root_names(tokens, i, here, &mut out);
                }
            }
            _ => {}
        }
    }
    out
}

/// The root names of the path starting at `tokens[i]` (`crate`, `self` or `super`), seen
/// from module `here`.
fn path_root_names(
    tokens: &[Token],
    mut i: usize,
    here: Vec<String>,
    out: &mut Vec<(String, usize)>,
) {
    let mut base = match ident(tokens, i) {
        Some("crate") => Vec::new(),
        Some("self") => here,
        _ => {
            let mut up = here;
            if up.pop().is_none() {
                return;
            }
            up
        }
    };
    while ident(tokens, i + 2) == Some("super") && is(tokens, i + 1, &Tok::PathSep) {
        if base.pop().is_none() {
            return;
        }
        i += 2;
    }
    if let Some(first) = base.first() {
        out.push((first.clone(), tokens[i].line));
        return;
    }
    // At the root: the next segment, or each element of a group.
    match tokens.get(i + 2).map(|t| &t.tok) {
        Some(Tok::Ident(name)) => out.push((name.clone(), tokens[i + 2].line)),
        Some(Tok::Punct('{')) => {
            let mut nest = 0;
            let mut element_start = true;
            for t in &tokens[i + 2..] {
                match &t.tok {
                    Tok::Punct('{') => {
                        nest += 1;
                        if nest == 1 {
                            continue;
                        }
                    }
                    Tok::Punct('}') => {
                        nest -= 1;
                        if nest == 0 {
                            break;
                        }
                    }
                    Tok::Punct(',') if nest == 1 => {
                        element_start = true;
                        continue;
                    }
                    Tok::Ident(name) if nest == 1 && element_start && name != "self" => {
                        out.push((name.clone(), t.line));
                    }
                    _ => {}
                }
                element_start = false;
            }
        }
        _ => {}
    }
}

/// The names a crate root's `use` items bind and the first segment of the path each comes
/// from: `pub use error::{Error, Result as R};` gives `(Error, error)` and `(R, error)`.
pub fn root_uses(tokens: &[Token]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i].tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth -= 1,
            Tok::Ident(w) if w == "use" && depth == 0 => {
                let end = (i..tokens.len())
                    .find(|&j| is(tokens, j, &Tok::Punct(';')))
                    .unwrap_or(tokens.len());
                let mut pos = i + 1;
                use_tree(&tokens[..end], &mut pos, Vec::new(), &mut out);
                i = end;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Parses one use tree at `*pos` under `prefix`, adding the (bound name, first segment)
/// of each leaf.
fn use_tree(
    tokens: &[Token],
    pos: &mut usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(String, String)>,
) {
    loop {
        match tokens.get(*pos).map(|t| &t.tok) {
            Some(Tok::PathSep) => *pos += 1,
            Some(Tok::Punct('{')) => {
                *pos += 1;
                while *pos < tokens.len() && !is(tokens, *pos, &Tok::Punct('}')) {
                    use_tree(tokens, pos, prefix.clone(), out);
                    if is(tokens, *pos, &Tok::Punct(',')) {
                        *pos += 1;
                    }
                }
                *pos += 1;
                return;
            }
            Some(Tok::Ident(name)) => {
                *pos += 1;
                let leaf = if name == "self" {
                    prefix.last().cloned()
                } else {
                    if name != "crate" {
                        prefix.push(name.clone());
                    }
                    Some(name.clone())
                };
                if is(tokens, *pos, &Tok::PathSep) && name != "self" {
                    continue;
                }
                let bound = if ident(tokens, *pos) == Some("as") {
                    *pos += 2;
                    ident(tokens, *pos - 1).map(str::to_string)
                } else {
                    leaf
                };
                if let (Some(bound), Some(first)) = (bound, prefix.first()) {
                    out.push((bound, first.clone()));
                }
                return;
            }
            // A glob, or the end of the item.
            _ => {
                *pos += 1;
                return;
            }
        }
    }
}
