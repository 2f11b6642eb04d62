//! The docs stay true to themselves: every relative link in the README, ARCHITECTURE.md and
//! `docs/` names a file that exists and, with `#anchor`, a heading it has (GitHub's anchors).
//! No root needed.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files the docs are made of.
pub fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md"), repo().join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// GitHub's anchor for a heading: lowercased, punctuation but `-` and `_` dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced && let Some(h) = line.strip_prefix('#') {
            out.insert(anchor(h.trim_start_matches('#')));
        }
    }
    out
}

/// `(target, line)` of every inline link `](target)` outside code blocks and code spans.
fn links(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans hold examples, not links.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join("");
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            out.push((rest[..end].to_string(), n + 1));
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for (target, line) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() { file.clone() } else { dir.join(path) };
            let name = format!("{}:{line}: {target}", file.strip_prefix(repo()).unwrap_or(&file).display());
            if !resolved.exists() {
                broken.push(format!("{name}: no such file"));
                continue;
            }
            if let Some(fragment) = fragment
                && resolved.extension().is_some_and(|e| e == "md")
            {
                let target_text = std::fs::read_to_string(&resolved).unwrap();
                if !anchors(&target_text).contains(fragment) {
                    broken.push(format!("{name}: no heading with that anchor"));
                }
            }
            checked += 1;
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 100, "only {checked} links");
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(
        anchor(" What is programmed: `nftproxy status`, `/debug/services`"),
        "what-is-programmed-nftproxy-status-debugservices"
    );
    assert_eq!(anchor("iptables (iptables-nft)"), "iptables-iptables-nft");
    assert_eq!(anchor("The API server's address"), "the-api-servers-address");
}

/// What a figure measures, in base units (seconds, bytes, a plain ratio, a percentage, a
/// count or rate).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dim {
    Time,
    Bytes,
    Ratio,
    Percent,
    Plain,
}

/// A figure as written: its value in base units, its dimension, and how far a value may lie
/// from it and still print as it (half the last digit written).
#[derive(Debug, Clone, Copy)]
struct Figure {
    value: f64,
    dim: Dim,
    tolerance: f64,
}

const UNITS: &[(&str, Dim, f64)] = &[
    ("conn/s", Dim::Plain, 1.0),
    ("/s", Dim::Plain, 1.0),
    ("µs", Dim::Time, 1e-6),
    ("ms", Dim::Time, 1e-3),
    ("min", Dim::Time, 60.0),
    ("s", Dim::Time, 1.0),
    ("KiB", Dim::Bytes, 1024.0),
    ("MiB", Dim::Bytes, 1_048_576.0),
    ("GiB", Dim::Bytes, 1_073_741_824.0),
    ("KB", Dim::Bytes, 1e3),
    ("MB", Dim::Bytes, 1e6),
    ("bytes", Dim::Bytes, 1.0),
    ("%", Dim::Percent, 1.0),
    ("×", Dim::Ratio, 1.0),
];

/// The figures of a text: numbers with a unit (a ratio's `×` right after the number; `10,000 ×
/// 10` is a size), ranges `A–B UNIT` as two; with `plain`, numbers without a unit too.
fn figures(text: &str, plain: bool) -> Vec<(Figure, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let number_at = |i: usize| -> Option<(f64, f64, usize)> {
        let start = i;
        let mut j = i;
        while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == ',' || chars[j] == '.') {
            j += 1;
        }
        while j > start && !chars[j - 1].is_ascii_digit() {
            j -= 1;
        }
        let s: String = chars[start..j].iter().filter(|c| **c != ',').collect();
        let value: f64 = s.parse().ok()?;
        let decimals = s.split_once('.').map_or(0, |(_, d)| d.len());
        Some((value, 0.5 * 10f64.powi(-(decimals as i32)), j))
    };
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '.' || chars[i - 1] == '_'));
        if !starts {
            i += 1;
            continue;
        }
        let Some((a, tol_a, mut j)) = number_at(i) else {
            i += 1;
            continue;
        };
        let mut values = vec![(a, tol_a)];
        if j + 1 < chars.len()
            && (chars[j] == '–' || chars[j] == '-')
            && chars[j + 1].is_ascii_digit()
            && let Some((b, tol_b, k)) = number_at(j + 1)
        {
            values.push((b, tol_b));
            j = k;
        }
        let line = chars[..i].iter().filter(|c| **c == '\n').count() + 1;
        let spaced = j < chars.len() && (chars[j] == ' ' || chars[j] == '\u{202f}' || chars[j] == '\u{a0}');
        let from = if spaced { j + 1 } else { j };
        let rest: String = chars[from..chars.len().min(from + 8)].iter().collect();
        let unit = UNITS.iter().find(|(u, dim, _)| {
            rest.starts_with(u)
                && !(*dim == Dim::Ratio && spaced)
                && !rest[u.len()..].chars().next().is_some_and(|c| c.is_alphanumeric())
        });
        match unit {
            Some((u, dim, scale)) => {
                for (v, tol) in values {
                    out.push((Figure { value: v * scale, dim: *dim, tolerance: tol * scale }, line));
                }
                i = from + u.chars().count();
            }
            None => {
                if plain {
                    for (v, tol) in values {
                        out.push((Figure { value: v, dim: Dim::Plain, tolerance: tol }, line));
                    }
                }
                i = j;
            }
        }
    }
    out
}

/// Every figure of every results file (`docs/performance/results/`), with the unitless ones.
fn recorded() -> Vec<Figure> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(repo().join("docs/performance/results")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            out.extend(figures(&std::fs::read_to_string(&path).unwrap(), true).into_iter().map(|(f, _)| f));
        }
    }
    out
}

fn is_recorded(f: &Figure, recorded: &[Figure]) -> bool {
    recorded.iter().any(|r| {
        let same_dim = r.dim == f.dim || (f.dim == Dim::Plain && r.dim == Dim::Plain);
        same_dim && (r.value.abs() - f.value.abs()).abs() <= f.tolerance + f.value.abs() * 1e-9
    })
}

/// A section of a Markdown file: from its heading to the next of the same or a higher level.
fn section(text: &str, heading: &str) -> String {
    let Some(start) = text.find(heading) else { return String::new() };
    let level = heading.chars().take_while(|c| *c == '#').count();
    let rest = &text[start + heading.len()..];
    let end = rest
        .match_indices("\n#")
        .find(|(at, _)| rest[at + 1..].chars().take_while(|c| *c == '#').count() <= level)
        .map_or(rest.len(), |(at, _)| at);
    format!("{heading}{}", &rest[..end])
}

/// Figures the docs quote, each found in a results file (within the precision it is written
/// with): the README's Performance section, install.md's Sizing section, and every figure in
/// MiB anywhere in the docs (a process's memory: the figure the docs used to give four ways).
/// Figures that are not a benchmark's are listed with why.
#[test]
fn every_figure_the_docs_quote_is_in_a_results_file() {
    let recorded = recorded();
    let read = |p: &str| std::fs::read_to_string(repo().join(p)).unwrap();
    let mut quoted: Vec<(String, String, Figure, usize)> = Vec::new();
    let mut take = |file: &str, text: &str, offset: usize, only_memory: bool| {
        for (f, line) in figures(text, false) {
            let mib = text.lines().nth(line - 1).is_some_and(|l| l.contains("MiB"));
            if !only_memory || (f.dim == Dim::Bytes && mib) {
                quoted.push((file.to_string(), text.lines().nth(line - 1).unwrap_or("").to_string(), f, line + offset));
            }
        }
    };
    let readme = read("README.md");
    let perf = section(&readme, "## Performance");
    take("README.md", &perf, readme[..readme.find("## Performance").unwrap()].lines().count(), false);
    let install = read("docs/install.md");
    let sizing = section(&install, "### Sizing");
    take("docs/install.md", &sizing, install[..install.find("### Sizing").unwrap()].lines().count(), false);
    for file in markdown_files() {
        let name = file.strip_prefix(repo()).unwrap().display().to_string();
        take(&name, &std::fs::read_to_string(&file).unwrap(), 0, true);
    }
    // Not a benchmark's figure: the image's size, which `scripts/images` prints when it builds
    // it (docs/install.md#the-image).
    let not_benchmarks = [
        "compressed (what a registry stores",
        "unpacked, 19 MiB of it the binary",
        "(0.8 MiB more)",
        "8.5 MiB",
        "nftproxy 8.5 and 22.7 MiB",
    ];
    let missing: Vec<String> = quoted
        .iter()
        .filter(|(_, text, f, _)| !is_recorded(f, &recorded) && !not_benchmarks.iter().any(|n| text.contains(n)))
        .map(|(file, text, f, line)| format!("{file}:{line}: {f:?} in: {}", text.trim()))
        .collect();
    assert!(missing.is_empty(), "figures no results file holds:\n{}", missing.join("\n"));
    assert!(quoted.len() > 20, "{} figures", quoted.len());
}

#[test]
fn figures_are_read_with_their_units_and_precision() {
    let f = figures("1.60 s; 77 MiB | 63.9 s (40×); 10,000 × 10; 0.26–0.37 s; 17,333/s (−7.9%)", false);
    let v: Vec<(f64, Dim)> = f.iter().map(|(f, _)| (f.value, f.dim)).collect();
    assert_eq!(v.len(), 8, "{v:?}");
    assert_eq!(v[0], (1.6, Dim::Time));
    assert_eq!(v[1], (77.0 * 1_048_576.0, Dim::Bytes));
    assert_eq!(v[3], (40.0, Dim::Ratio));
    assert_eq!((v[4].1, v[5].1), (Dim::Time, Dim::Time));
    assert_eq!(v[6], (17333.0, Dim::Plain));
    assert!(is_recorded(&f[0].0, &figures("1600 ms", true).iter().map(|(f, _)| *f).collect::<Vec<_>>()));
    assert!(!is_recorded(&f[0].0, &figures("1612 ms", true).iter().map(|(f, _)| *f).collect::<Vec<_>>()));
}
