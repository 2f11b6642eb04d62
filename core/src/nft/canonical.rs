//! A canonical form of nft ruleset text, to compare `nft list ruleset` with [`super::render`].
//!
//! nft prints sets and chains in the order they were created and set elements in hash order,
//! wrapped to its line width. Canonical text sorts tables, blocks and elements and puts one
//! element per line, and drops `#` comments (lines, and nft's `# progname` after an owned table's
//! header) and the table flags `owner` and `persist` (ownership belongs
//! to the running process, not to the planned ruleset; nft 1.0.6 prints `owner`/`persist` as a
//! bare `flags`) and the values of counters (`counter packets 3 bytes 180` reads as
//! `counter packets 0 bytes 0`: traffic, not the ruleset, moves them); everything else (every rule, every attribute line) must match exactly.

/// Canonical form of ruleset text.
pub fn canonicalize(text: &str) -> String {
    let mut tables: Vec<String> = Vec::new();
    let zeroed: Vec<String> = text.lines().map(counters_zeroed).collect();
    let mut lines = zeroed.iter().map(String::as_str).peekable();
    while let Some(line) = lines.next() {
        // An owned table's header carries nft's `# progname …` comment.
        let trimmed = match line.trim().split_once(" { #") {
            Some((header, _)) if header.starts_with("table ") => format!("{header} {{"),
            _ => line.trim().to_string(),
        };
        let trimmed = trimmed.as_str();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if trimmed.starts_with("table ") && trimmed.ends_with('{') {
            let mut body: Vec<String> = Vec::new();
            for inner in lines.by_ref() {
                if inner.trim_end() == "}" {
                    break;
                }
                body.push(inner.to_string());
            }
            tables.push(format!("{trimmed}\n{}}}\n", canonical_table_body(&body)));
        } else {
            tables.push(format!("{trimmed}\n"));
        }
    }
    tables.sort();
    tables.concat()
}

/// The line with every `counter packets N bytes M` as `counter packets 0 bytes 0`.
fn counters_zeroed(line: &str) -> String {
    const COUNTER: &str = "counter packets ";
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(COUNTER) {
        let (before, after) = rest.split_at(at + COUNTER.len());
        out.push_str(before);
        let digits = |s: &str| s.bytes().take_while(u8::is_ascii_digit).count();
        let after = &after[digits(after)..];
        match after.strip_prefix(" bytes ") {
            Some(bytes) => {
                out.push_str("0 bytes 0");
                rest = &bytes[digits(bytes)..];
            }
            None => {
                out.push('0');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A table's `flags` line without `owner` and `persist` (which belong to the running process);
/// `None` for any other line. nft 1.0.6 prints a bare `flags` for flags it has no name for.
fn process_flags_removed(line: &str) -> Option<String> {
    let rest = line.strip_prefix("flags")?;
    if !rest.is_empty() && !rest.starts_with(' ') {
        return None;
    }
    let kept: Vec<&str> =
        rest.split(',').map(str::trim).filter(|f| !f.is_empty() && *f != "owner" && *f != "persist").collect();
    Some(kept.join(","))
}

fn canonical_table_body(body: &[String]) -> String {
    let mut header: Vec<String> = Vec::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut i = 0;
    while i < body.len() {
        let line = body[i].trim();
        i += 1;
        if line.is_empty() {
            continue;
        }
        if line.ends_with('{') && (line.starts_with("set ") || line.starts_with("map ") || line.starts_with("chain ")) {
            let mut block_lines: Vec<String> = Vec::new();
            while i < body.len() && body[i].trim() != "}" {
                block_lines.push(body[i].trim().to_string());
                i += 1;
            }
            i += 1;
            blocks.push(format!("\t{line}\n{}\t}}\n", canonical_block(&block_lines)));
        } else if let Some(flags) = process_flags_removed(line) {
            if !flags.is_empty() {
                header.push(format!("\tflags {flags}\n"));
            }
        } else {
            header.push(format!("\t{line}\n"));
        }
    }
    blocks.sort();
    format!("{}{}", header.concat(), blocks.concat())
}

fn canonical_block(lines: &[String]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = &lines[i];
        i += 1;
        if let Some(rest) = line.strip_prefix("elements = {") {
            let mut text = rest.to_string();
            while !text.trim_end().ends_with('}') && i < lines.len() {
                text.push(' ');
                text.push_str(&lines[i]);
                i += 1;
            }
            let inner = text.trim().trim_end_matches('}').trim();
            let mut elements = split_elements(inner);
            elements.sort();
            out.push_str("\t\telements = {\n");
            for e in elements {
                out.push_str(&format!("\t\t\t{e}\n"));
            }
            out.push_str("\t\t}\n");
        } else {
            out.push_str(&format!("\t\t{line}\n"));
        }
    }
    out
}

/// Splits an element list at top-level commas (commas inside quoted comments stay).
fn split_elements(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                current.push(c);
            }
            ',' if !quoted => {
                push_element(&mut out, &current);
                current.clear();
            }
            _ => current.push(c),
        }
    }
    push_element(&mut out, &current);
    out
}

fn push_element(out: &mut Vec<String>, raw: &str) {
    let collapsed = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    if !collapsed.is_empty() {
        out.push(collapsed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_values_are_forgiven_but_a_missing_counter_is_not() {
        let listed = "10.0.0.1 . tcp . 80 counter packets 12 bytes 720 comment \"a/b:http\" : goto x";
        assert_eq!(
            counters_zeroed(listed),
            "10.0.0.1 . tcp . 80 counter packets 0 bytes 0 comment \"a/b:http\" : goto x"
        );
        let two = "a counter packets 1 bytes 2, b counter packets 33 bytes 44";
        assert_eq!(counters_zeroed(two), "a counter packets 0 bytes 0, b counter packets 0 bytes 0");
        assert_eq!(counters_zeroed("counter packets 7"), "counter packets 0");
        let plain = "10.0.0.1 . tcp . 80 comment \"a/b:http\" : goto x";
        assert_ne!(counters_zeroed(listed), counters_zeroed(plain));
    }

    #[test]
    fn ownership_is_forgiven_but_a_dormant_table_is_not() {
        let planned = "table ip t {\n\tcomment \"x\"\n\tchain a {\n\t}\n}\n";
        let owned = "table ip t { # progname nftproxy\n\tflags owner\n\tcomment \"x\"\n\tchain a {\n\t}\n}\n";
        let orphaned = "table ip t {\n\tflags\n\tcomment \"x\"\n\tchain a {\n\t}\n}\n";
        let dormant = "table ip t {\n\tflags dormant,owner\n\tcomment \"x\"\n\tchain a {\n\t}\n}\n";
        assert_eq!(canonicalize(owned), canonicalize(planned));
        assert_eq!(canonicalize(orphaned), canonicalize(planned));
        assert_ne!(canonicalize(dormant), canonicalize(planned));
        assert!(canonicalize(dormant).contains("\tflags dormant\n"));
    }

    #[test]
    fn element_order_and_wrapping_do_not_matter() {
        let a = "table ip t {\n\tset s {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.2, 10.0.0.1,\n\t\t\t     10.0.0.3 }\n\t}\n\n\tchain b {\n\t\tjump a\n\t}\n\n\tchain a {\n\t}\n}\n";
        let b = "table ip t {\n\tchain a {\n\t}\n\tchain b {\n\t\tjump a\n\t}\n\tset s {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.1, 10.0.0.3, 10.0.0.2 }\n\t}\n}\n";
        assert_eq!(canonicalize(a), canonicalize(b));
    }

    #[test]
    fn rules_and_comments_still_matter() {
        let a = "table ip t {\n\tchain a {\n\t\tjump b\n\t\tjump c\n\t}\n}\n";
        let b = "table ip t {\n\tchain a {\n\t\tjump c\n\t\tjump b\n\t}\n}\n";
        assert_ne!(canonicalize(a), canonicalize(b));
        let c = "table ip t {\n\tmap m {\n\t\telements = { 1 comment \"a, b\" : drop, 2 : accept }\n\t}\n}\n";
        assert!(canonicalize(c).contains("1 comment \"a, b\" : drop"));
    }
}
