//! Suggestions for misspelled names: pass names here, and the ops, dtypes, dimensions
//! and tensors of a `fusion!` (the macro's messages say "did you mean `relu`?").

/// The closest candidate to `name` by edit distance, when it is close enough to be a typo.
pub fn suggest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    // One-letter names (dimension symbols, mostly) are only corrected for case: any other
    // letter is one edit away, which says nothing.
    let short = name.chars().count() == 1;
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .filter(|c| *c != name && (!short || c.eq_ignore_ascii_case(name)))
        .map(|c| (edit_distance(name, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Levenshtein distance where swapping two adjacent characters counts as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_catch_typos_only() {
        let ops = ["relu", "gelu", "matmul", "sum", "sigmoid"];
        assert_eq!(suggest("rleu", ops), Some("relu"));
        assert_eq!(suggest("matmull", ops), Some("matmul"));
        assert_eq!(suggest("sigmod", ops), Some("sigmoid"));
        assert_eq!(suggest("softmax", ops), None);
        assert_eq!(suggest("q", ["m", "n", "k"]), None);
        assert_eq!(suggest("M", ["m", "n", "k"]), Some("m"));
        assert_eq!(edit_distance("abc", "abc"), 0);
        assert_eq!(edit_distance("ab", "ba"), 1);
    }
}
