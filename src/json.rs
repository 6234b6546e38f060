//! How deep JSON text nests, in one pass and without parsing it: the
//! Python side's check before it hands a header or sidecar to `json.loads`,
//! whose C decoder recurses once per level (past a raised recursion limit,
//! a hostile file nested a million deep overflows the C stack).

/// The deepest nesting of arrays and objects in `text` (the outermost
/// counted as 1), strings skipped (a `\` escapes the byte after it),
/// counted up to `limit`: the scan stops once `limit` is reached. Text
/// that is not JSON gets a number too (brackets outside strings counted,
/// closing ones past the outermost ignored); the parser refuses it.
pub fn max_depth(text: &[u8], limit: usize) -> usize {
    let (mut depth, mut deepest, mut i) = (0usize, 0usize, 0usize);
    while i < text.len() {
        match text[i] {
            b'[' | b'{' => {
                depth += 1;
                if depth > deepest {
                    deepest = depth;
                    if deepest >= limit {
                        return deepest;
                    }
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'"' => {
                i += 1;
                while i < text.len() {
                    match text[i] {
                        b'\\' => i += 1,
                        b'"' => break,
                        _ => {}
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::max_depth;

    #[test]
    fn counts_arrays_and_objects() {
        assert_eq!(max_depth(b"", 128), 0);
        assert_eq!(max_depth(b"1", 128), 0);
        assert_eq!(max_depth(b"{}", 128), 1);
        assert_eq!(max_depth(br#"{"a":[1,{"b":[]}],"c":{}}"#, 128), 4);
        assert_eq!(max_depth(b"[[],[],[[]]]", 128), 3);
    }

    #[test]
    fn skips_strings_and_their_escapes() {
        assert_eq!(max_depth(br#"{"[[[{{":"]]]"}"#, 128), 1);
        assert_eq!(max_depth(br#"{"a\"[[[":"\\","b":[]}"#, 128), 2);
        assert_eq!(max_depth(br#"["\\\"[["]"#, 128), 1);
        // An unterminated string runs to the end.
        assert_eq!(max_depth(br#"{"a":"[[[["#, 128), 1);
        assert_eq!(max_depth(b"[\"\\", 128), 1);
    }

    #[test]
    fn stops_at_the_limit() {
        let deep = [b"[".repeat(1_000_000), b"]".repeat(1_000_000)].concat();
        assert_eq!(max_depth(&deep, 128), 128);
        assert_eq!(max_depth(&deep, usize::MAX), 1_000_000);
        let wide = b"[[]]".repeat(10_000);
        assert_eq!(max_depth(&wide, 128), 2);
        // Closing brackets past the outermost do not go below zero.
        assert_eq!(max_depth(b"]]]][[", 128), 2);
    }
}
