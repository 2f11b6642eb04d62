//! The house's shape, checked: the pure core depends on nothing that reaches the kernel, the
//! network or the API server, and no two files of a crate import each other, directly or around
//! a loop. (No root needed.)

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
/// and `b.rs` uses `a.rs`, or around several files) means two rooms that are really one, or a
/// name in the wrong room.
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
