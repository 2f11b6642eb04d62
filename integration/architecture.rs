//! The code's shape, checked: the pure core depends on nothing that reaches the kernel, the
//! network or the API server; no module imports from a module that imports it, directly or
//! around a loop (a folder's `mod.rs` and its files included); and ARCHITECTURE.md's module map
//! and walks match the tree. (No root needed.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `[dependencies]` table of a Cargo.toml, by crate name.
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut names = BTreeSet::new();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == "[dependencies]";
        } else if inside && let Some((name, _)) = line.split_once('=') {
            names.insert(name.trim().to_string());
        }
    }
    names
}

/// `nftproxy-core` is pure: its dependencies are value crates, and its code names no crate
/// that performs the effects (those live in the agent crate).
#[test]
fn the_core_crate_reaches_no_kernel_network_or_api_server() {
    let allowed = [
        "data-encoding",
        "humantime",
        "indexmap",
        "ipnet",
        "serde",
        "serde_json",
        "serde_path_to_error",
        "serde_yaml_ng",
        "sha2",
        "smallvec",
        "thiserror",
        "tracing",
    ];
    let deps = dependencies(&root().join("core/Cargo.toml"));
    let extra: Vec<&String> = deps.iter().filter(|d| !allowed.contains(&d.as_str())).collect();
    assert!(extra.is_empty(), "core/Cargo.toml depends on {extra:?}: effects belong in the agent crate (src/)");
    for file in rust_files(&root().join("core/src")) {
        let text = std::fs::read_to_string(&file).unwrap();
        for needle in
            ["libc::", "nix::", "tokio::", "kube::", "mnl::", "nftnl::", "nftnl_sys::", "std::process", "TcpStream"]
        {
            assert!(!text.contains(needle), "{} uses {needle}: the core must stay pure", file.display());
        }
    }
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// One crate's files as modules: the module path of each file (`["plan", "placement"]`), the
/// crate root being `[]`.
struct Modules {
    by_path: BTreeMap<Vec<String>, PathBuf>,
}

impl Modules {
    /// A crate's modules, without its unit tests (`#[cfg(test)] mod tests;`): tests import
    /// whatever they test. Other test-only modules (fixtures, hostile input, round trips) are
    /// modules like any other.
    fn of(src: &Path) -> Modules {
        let mut test_only = BTreeSet::new();
        for file in rust_files(src) {
            let text = std::fs::read_to_string(&file).unwrap();
            let mut previous = "";
            for line in text.lines().map(str::trim) {
                if previous.starts_with("#[cfg(") && previous.contains("test") {
                    let declared = line.strip_prefix("pub ").unwrap_or(line);
                    if declared == "mod tests;" {
                        let folder =
                            if file.ends_with("mod.rs") || file.ends_with("lib.rs") || file.ends_with("main.rs") {
                                file.parent().unwrap().to_path_buf()
                            } else {
                                file.with_extension("")
                            };
                        test_only.insert(folder.join("tests.rs"));
                        test_only.insert(folder.join("tests").join("mod.rs"));
                    }
                }
                previous = line;
            }
        }
        let mut by_path = BTreeMap::new();
        for file in rust_files(src).into_iter().filter(|f| !test_only.contains(f)) {
            let relative = file.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                parts.pop();
            }
            by_path.entry(parts).or_insert(file);
        }
        Modules { by_path }
    }

    fn module_of(&self, file: &Path) -> Vec<String> {
        self.by_path.iter().find(|(_, f)| f.as_path() == file).map(|(m, _)| m.clone()).unwrap()
    }

    /// The file a path names: the deepest module file along it; a name a `mod.rs` only hands on
    /// (`pub use child::Name`) is followed into the child, as it is defined there.
    fn resolve(&self, path: &[String]) -> Option<&PathBuf> {
        let depth = (0..=path.len()).rev().find(|n| self.by_path.contains_key(&path[..*n]))?;
        let module = &path[..depth];
        let file = &self.by_path[module];
        if let Some(name) = path.get(depth) {
            let text = std::fs::read_to_string(file).unwrap();
            for child in self.by_path.keys().filter(|m| m.len() == depth + 1 && m.starts_with(module)) {
                let child_name = &child[depth];
                let hands_on = text.lines().any(|l| {
                    let l = l.trim();
                    l.starts_with("pub use ")
                        && (l.contains(&format!("{child_name}::{name}"))
                            || (l.contains(&format!("{child_name}::{{")) && l.contains(name.as_str()))
                            || l.contains(&format!("{child_name}::*")))
                });
                if hands_on {
                    return Some(&self.by_path[child]);
                }
            }
        }
        Some(file)
    }
}

/// A `use` tree expanded into its paths: `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<Vec<String>> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or("").trim();
        return vec![path.split("::").filter(|s| !s.is_empty()).map(str::to_string).collect()];
    };
    let prefix: Vec<String> =
        tree[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut start, mut out) = (0, 0, Vec::new());
    let mut parts = Vec::new();
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    for part in parts.into_iter().filter(|p| !p.trim().is_empty()) {
        for tail in expand(part) {
            let mut path = prefix.clone();
            path.extend(tail.into_iter().filter(|s| s != "self"));
            out.push(path);
        }
    }
    out
}

/// Makes a path absolute within its crate: `crate::`, `super::`, `self::`, the crate's own
/// name, and (in a folder's `mod.rs`) a child module's name; `None` for other crates' paths.
fn absolute(path: &[String], here: &[String], crate_name: &str, children: &BTreeSet<String>) -> Option<Vec<String>> {
    let first = path.first()?;
    let (mut base, rest): (Vec<String>, &[String]) = match first.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (here.to_vec(), &path[1..]),
        "super" => (here.to_vec(), path),
        name if name == crate_name => (Vec::new(), &path[1..]),
        name if children.contains(name) => (here.to_vec(), path),
        _ => return None,
    };
    let mut out = Vec::new();
    for segment in rest {
        if segment == "super" && out.is_empty() {
            base.pop();
        } else {
            out.push(segment.clone());
        }
    }
    base.extend(out);
    Some(base)
}

/// The module paths a file's `use` items and inline `crate::` paths name, made absolute.
/// A file's `#[cfg(test)] mod tests` is left out: tests import whatever they test.
fn imported_paths(text: &str, here: &[String], crate_name: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut code = String::new();
    let mut previous = "";
    for line in text.lines() {
        let trimmed = line.trim();
        let declared =
            ["pub ", "pub(crate) ", "pub(super) "].iter().fold(trimmed, |t, v| t.strip_prefix(v).unwrap_or(t));
        if previous == "#[cfg(test)]" && declared.starts_with("mod ") && declared.ends_with('{') {
            break;
        }
        previous = trimmed;
        if !trimmed.starts_with("//") {
            code.push_str(line);
            code.push('\n');
        }
    }
    let mut out = Vec::new();
    // `use` items, which may span lines.
    for statement in code.split(';') {
        let statement = statement.trim();
        let Some(at) = statement.find("use ") else { continue };
        let head = statement[..at].trim();
        if !(head.is_empty()
            || head.ends_with("pub")
            || head.ends_with(')')
            || head.ends_with(']')
            || head.ends_with('}'))
        {
            continue;
        }
        if !head.is_empty() && !statement[..at].ends_with(char::is_whitespace) {
            continue;
        }
        for path in expand(&statement[at + 4..]) {
            out.extend(absolute(&path, here, crate_name, children));
        }
    }
    // Paths written inline: `crate::plan::names::chain(..)`, `super::render(..)`, and from a
    // module to its own children, `service::balanced(..)`.
    let is_path_char = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let starts = ["crate::".to_string(), "super::".to_string(), "self::".to_string()]
        .into_iter()
        .chain(children.iter().map(|c| format!("{c}::")));
    for start in starts {
        for (i, _) in code.match_indices(start.as_str()) {
            if code[..i].ends_with(is_path_char) {
                continue;
            }
            let path: Vec<String> = code[i..]
                .split(|c: char| !is_path_char(c))
                .next()
                .unwrap_or("")
                .split("::")
                .map(str::to_string)
                .collect();
            out.extend(absolute(&path, here, crate_name, children));
        }
    }
    out
}

/// Who imports whom among one crate's files: for each file, the files it imports, each with
/// the paths that name it.
type Arrows = BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>;

/// Who imports whom among one crate's files.
fn arrows(src: &Path, crate_name: &str) -> (Modules, Arrows) {
    let modules = Modules::of(src);
    let mut arrows = Arrows::new();
    for file in modules.by_path.values() {
        let here = modules.module_of(file);
        // `use` paths are relative to the module the file is (a `mod.rs` is its folder's module).
        let text = std::fs::read_to_string(file).unwrap();
        let children: BTreeSet<String> = modules
            .by_path
            .keys()
            .filter(|m| m.len() == here.len() + 1 && m.starts_with(&here))
            .map(|m| m[here.len()].clone())
            .collect();
        let targets = arrows.entry(file.clone()).or_default();
        for path in imported_paths(&text, &here, crate_name, &children) {
            if let Some(target) = modules.resolve(&path)
                && target != file
            {
                targets.entry(target.clone()).or_default().insert(path.join("::"));
            }
        }
    }
    (modules, arrows)
}

/// The files each file imports, without the names.
fn targets(arrows: &Arrows) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    arrows.iter().map(|(from, to)| (from.clone(), to.keys().cloned().collect())).collect()
}

/// The loops among one crate's files (strongly connected components of more than one file),
/// each as its files and the arrows between them.
fn circles(src: &Path, crate_name: &str) -> Vec<String> {
    let (_, arrows) = arrows(src, crate_name);
    let relative = |f: &PathBuf| f.strip_prefix(src).unwrap_or(f).display().to_string();
    loops(&targets(&arrows))
        .into_iter()
        .map(|circle| {
            let mut lines = vec![circle.iter().map(relative).collect::<Vec<_>>().join(", ")];
            for from in &circle {
                for (to, names) in arrows[from].iter().filter(|(to, _)| circle.contains(to)) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    lines.push(format!("    {} -> {}: {}", relative(from), relative(to), names.join(", ")));
                }
            }
            lines.join("\n")
        })
        .collect()
}

/// The loops among one crate's top-level modules (`health` → `metrics` → `health`), each
/// module standing for all of its files; the crate root, which declares them all, is left out.
fn module_circles(src: &Path, crate_name: &str) -> Vec<Vec<PathBuf>> {
    let (modules, file_arrows) = arrows(src, crate_name);
    let top = |file: &PathBuf| modules.module_of(file).first().map(|m| PathBuf::from(m.as_str()));
    let mut arrows: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (from, targets) in &file_arrows {
        let Some(from) = top(from) else { continue };
        let entry = arrows.entry(from.clone()).or_default();
        entry.extend(targets.keys().filter_map(top).filter(|to| *to != from));
    }
    loops(&arrows)
}

/// Strongly connected components of more than one node.
fn loops(arrows: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    // Tarjan's algorithm (recursive: a crate has about a hundred files).
    struct Walk<'a> {
        arrows: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a PathBuf) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.arrows.get(v).into_iter().flatten() {
                let Some(w) = self.arrows.get_key_value(w).map(|(k, _)| k) else { continue };
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        arrows,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in arrows.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Each crate's files import one another in one direction only: a loop (`a.rs` uses `b.rs`
/// and `b.rs` uses `a.rs`, or around several files) means two modules that are really one, or
/// a name in the wrong module.
#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let mut found = Vec::new();
    for (src, name) in [("core/src", "nftproxy_core"), ("src", "nftproxy"), ("tools/src", "nftproxy_tools")] {
        for circle in circles(&root().join(src), name) {
            found.push(format!("{src}: {circle}"));
        }
        for circle in module_circles(&root().join(src), name) {
            let names: Vec<String> = circle.iter().map(|m| m.display().to_string()).collect();
            found.push(format!("{src}'s top-level modules: {}", names.join(", ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The circle finder finds circles: two files that import each other, a longer loop, and a
/// file that imports from the `mod.rs` above it while that imports the file.
#[test]
fn the_circle_finder_sees_a_loop() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir_all(src.join("plan")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod plan;\nmod nft;\nmod net;\n").unwrap();
    // plan/mod.rs hands `Thing` on from a.rs (not a circle by itself), defines `Shared` and
    // calls into c.rs, which imports `Shared` back up: a circle.
    std::fs::write(
        src.join("plan/mod.rs"),
        "mod a;\nmod b;\nmod c;\npub use a::Thing;\npub struct Shared;\nfn f() {\n    c::run();\n}\n",
    )
    .unwrap();
    std::fs::write(src.join("plan/a.rs"), "use super::b::Other;\npub struct Thing;\n").unwrap();
    std::fs::write(src.join("plan/b.rs"), "use crate::plan::Thing;\npub struct Other;\n").unwrap();
    std::fs::write(src.join("plan/c.rs"), "use super::Shared;\npub fn run() {}\n").unwrap();
    std::fs::write(src.join("nft.rs"), "use crate::net::X;\n").unwrap();
    std::fs::write(src.join("net.rs"), "pub struct X;\nfn f() {\n    let _ = crate::nft::Y;\n}\n").unwrap();
    let mut found: Vec<String> =
        circles(src, "demo").iter().map(|c| c.lines().next().unwrap_or_default().to_string()).collect();
    found.sort();
    assert_eq!(found, ["net.rs, nft.rs", "plan/a.rs, plan/b.rs", "plan/c.rs, plan/mod.rs"]);
    assert!(circles(src, "demo").iter().any(|c| c.contains("plan/c.rs -> plan/mod.rs: plan::Shared")));
    assert_eq!(module_circles(src, "demo"), vec![vec![PathBuf::from("net"), PathBuf::from("nft")]]);
}

// --- ARCHITECTURE.md against the tree --------------------------------------------------------

/// The crates' module tables of ARCHITECTURE.md, by the source directory each is headed with.
const CRATE_TABLES: [&str; 3] = ["core/src/", "src/", "tools/src/"];

/// ARCHITECTURE.md's tables: the heading each sits under (`core/src/`, `Elsewhere`) and its
/// rows, each as the row's path (its first column, in backticks) and role.
fn architecture_tables(text: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut tables: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("### ") {
            let name = heading.split('`').nth(1).unwrap_or(heading).to_string();
            tables.push((name, Vec::new()));
        } else if let Some(row) = line.strip_prefix("| `")
            && let Some((path, rest)) = row.split_once('`')
            && let Some((_, role)) = rest.split_once('|')
            && let Some((_, rows)) = tables.last_mut()
        {
            rows.push((path.to_string(), role.trim().trim_end_matches('|').trim().to_string()));
        }
    }
    tables.retain(|(_, rows)| !rows.is_empty());
    tables
}

/// A row's sort key: its module path (`plan/mod.rs` and `plan.rs` are `plan`, before
/// `plan/balance.rs`; the crate roots first), then its file name.
fn row_key(path: &str) -> (Vec<String>, String) {
    let relative = Path::new(path).with_extension("");
    let mut parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let file = parts.last().cloned().unwrap_or_default();
    if matches!(file.as_str(), "mod" | "lib" | "main") {
        parts.pop();
    }
    (parts, file)
}

/// Whether `name` is defined in `text`: an item (`fn`, `struct`, `enum`, `trait`, `type`,
/// `const`, `static`, `mod`, `macro_rules!`), or a field or variant at the start of a line.
fn defines(text: &str, name: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let item = ["fn ", "struct ", "enum ", "trait ", "type ", "const ", "static ", "mod ", "macro_rules! "];
    text.lines().map(str::trim_start).any(|line| {
        let line = ["pub(crate) ", "pub(super) ", "pub ", "unsafe ", "async ", "const fn "]
            .iter()
            .fold(line, |l, v| l.strip_prefix(v).unwrap_or(l));
        let after = item.iter().find_map(|kw| line.strip_prefix(kw)).unwrap_or(line);
        after.strip_prefix(name).is_some_and(|rest| !rest.starts_with(is_word))
            && (after.len() < line.len() || rest_is_declaration(&after[name.len()..]))
    })
}

/// What follows a name that starts a line when the line declares it: a field's `:`, a
/// variant's `(`, `{` or `,`.
fn rest_is_declaration(rest: &str) -> bool {
    let rest = rest.trim_start();
    rest.starts_with(':') && !rest.starts_with("::") || rest.starts_with(['(', '{', ',']) || rest.is_empty()
}

/// Whether `word` stands in `text` as a whole word.
fn mentions(text: &str, word: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word).any(|(i, _)| !text[..i].ends_with(is_word) && !text[i + word.len()..].starts_with(is_word))
}

/// The Rust names a row's role column names in backticks: types and constants (`ProxyConfig`,
/// `DELIBERATE`), and paths (`Kernel::read_counters`), by their last segment.
fn named_items(role: &str) -> Vec<String> {
    role.split('`')
        .skip(1)
        .step_by(2)
        .filter(|code| {
            let segments: Vec<&str> = code.split("::").collect();
            segments.iter().all(|s| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_'))
                && (segments.len() > 1 || code.starts_with(|c: char| c.is_ascii_uppercase()))
        })
        .filter_map(|code| code.rsplit("::").next().map(str::to_string))
        .collect()
}

/// Every source file of the three crates has a row in ARCHITECTURE.md's module map (unit tests
/// in `tests.rs` aside), every row's path exists, each table is sorted by module path (the
/// crate roots first, a folder's `mod.rs` before its files) and every type, constant or path a
/// row names in backticks is found in its file. The `Elsewhere` table's paths exist and are
/// sorted too.
#[test]
fn the_module_map_matches_the_tree() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let tables = architecture_tables(&text);
    let mut problems = Vec::new();
    for dir in CRATE_TABLES {
        let Some((_, rows)) = tables.iter().find(|(name, _)| name == dir) else {
            problems.push(format!("no module table for {dir}"));
            continue;
        };
        let listed: BTreeSet<&str> = rows.iter().map(|(path, _)| path.as_str()).collect();
        for file in rust_files(&root().join(dir)) {
            let relative = file.strip_prefix(root().join(dir)).unwrap().to_string_lossy().into_owned();
            if !file.ends_with("tests.rs") && !listed.contains(relative.as_str()) {
                problems.push(format!("{dir}{relative} has no row in ARCHITECTURE.md"));
            }
        }
        for (path, role) in rows {
            let Ok(source) = std::fs::read_to_string(root().join(dir).join(path)) else {
                problems.push(format!("ARCHITECTURE.md's row {dir}{path}: no such file"));
                continue;
            };
            for name in named_items(role) {
                if !mentions(&source, &name) {
                    problems
                        .push(format!("ARCHITECTURE.md's row {dir}{path} names `{name}`, which is not in the file"));
                }
            }
        }
        for pair in rows.windows(2) {
            if row_key(&pair[0].0) > row_key(&pair[1].0) {
                problems.push(format!("ARCHITECTURE.md's {dir} table: {} after {}", pair[1].0, pair[0].0));
            }
        }
    }
    match tables.iter().find(|(name, _)| name == "Elsewhere") {
        Some((_, rows)) => {
            for (path, _) in rows {
                if !root().join(path).exists() {
                    problems.push(format!("ARCHITECTURE.md's Elsewhere row {path}: no such path"));
                }
            }
            for pair in rows.windows(2) {
                if pair[0].0 > pair[1].0 {
                    problems.push(format!("ARCHITECTURE.md's Elsewhere table: {} after {}", pair[1].0, pair[0].0));
                }
            }
        }
        None => problems.push("no Elsewhere table in ARCHITECTURE.md".into()),
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The walks of ARCHITECTURE.md ("Where a change goes"): every file they name exists (a path
/// is from the repository's root, or else in `src/`), and every function or type they link to
/// a file (``[`Kernel::read_counters`](src/netlink/mod.rs)``) is defined in that file.
#[test]
fn the_walks_name_functions_where_they_are() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let walks = &text[text.find("## Where a change goes").expect("the walks' section")..];
    let mut problems = Vec::new();
    let mut links = 0;
    let exists = |path: &str| root().join(path).exists() || root().join("src").join(path).exists();
    for code in walks.split('`').skip(1).step_by(2) {
        if code.ends_with(".rs") && !code.contains(' ') && !exists(code) {
            problems.push(format!("the walks name {code}: no such file"));
        }
    }
    for (i, _) in walks.match_indices("](") {
        let Some(start) = walks[..i].rfind("[`") else { continue };
        let name = &walks[start + 2..i].trim_end_matches('`');
        let target = walks[i + 2..].split(')').next().unwrap_or("");
        if !target.ends_with(".rs") {
            continue;
        }
        links += 1;
        let Ok(source) = std::fs::read_to_string(root().join(target)) else {
            problems.push(format!("the walks link `{name}` to {target}: no such file"));
            continue;
        };
        let item = name.trim_end_matches("()").trim_end_matches('!');
        let item = item.strip_prefix("struct ").unwrap_or(item);
        let last = item.rsplit("::").next().unwrap_or(item);
        if !defines(&source, last) {
            problems.push(format!("the walks link `{name}` to {target}, which does not define {last}"));
        }
    }
    assert!(links > 20, "the walks link only {links} functions to their files");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checks of the module map see what they should.
#[test]
fn the_module_map_checks_see_a_wrong_row() {
    let doc = "### `src/` — x\n\n| module | role |\n|---|---|\n| `lib.rs` | the root |\n| `b.rs` | `Thing` and `a::run` |\n| `a.rs` | runs |\n\n### Elsewhere\n\n| path | role |\n|---|---|\n| `scripts/` | s |\n";
    let tables = architecture_tables(doc);
    assert_eq!(tables.len(), 2);
    let rows = &tables[0].1;
    assert_eq!(rows.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(), ["lib.rs", "b.rs", "a.rs"]);
    assert!(row_key("b.rs") > row_key("a.rs") && row_key("lib.rs") < row_key("a.rs"));
    assert!(row_key("plan/mod.rs") < row_key("plan/balance.rs") && row_key("plan.rs") < row_key("plan/a.rs"));
    assert_eq!(named_items(&rows[1].1), ["Thing", "run"]);
    assert!(defines("pub(crate) fn run(x: u8) {}", "run"));
    assert!(defines("impl Kernel {\n    pub fn read_counters(\n", "read_counters"));
    assert!(defines(
        "pub struct A {\n    pub load_balancer_source_ranges: Vec<IpNet>,\n}",
        "load_balancer_source_ranges"
    ));
    assert!(defines("macro_rules! watched_resource {", "watched_resource"));
    assert!(!defines("fn running() {}\nlet x = run(1);", "run"));
    assert!(mentions("pub const DELIBERATE: &[&str]", "DELIBERATE") && !mentions("DELIBERATELY", "DELIBERATE"));
}
