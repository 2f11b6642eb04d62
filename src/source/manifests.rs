//! Services, EndpointSlices and Nodes from YAML or JSON files: one file or a directory of them,
//! multi-document YAML, and `kind: List` (what `kubectl get svc,endpointslices,nodes -A -o yaml`
//! prints). A malformed object is reported with its file, position and name and skipped; the rest
//! still loads.

use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;
use thiserror::Error;

/// Errors that stop loading altogether.
#[derive(Debug, Error)]
pub enum ManifestError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} holds no .yaml, .yml or .json files")]
    Empty { path: PathBuf },
}

/// A malformed object or document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestProblem {
    pub file: PathBuf,
    /// Position: document index, and item index inside a List.
    pub position: String,
    pub name: Option<String>,
    pub reason: String,
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.file.display(), self.position)?;
        if let Some(n) = &self.name {
            write!(f, " ({n})")?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// Objects found in manifests, in file order.
#[derive(Debug, Default)]
pub struct Manifests {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    pub problems: Vec<ManifestProblem>,
    /// Objects of other kinds, ignored.
    pub ignored: usize,
    /// The files read.
    pub files: Vec<PathBuf>,
}

/// The manifest files under `path` (itself, if a file), sorted.
pub fn manifest_files(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let meta = std::fs::metadata(path).map_err(|source| ManifestError::Read { path: path.to_path_buf(), source })?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| ManifestError::Read { path: dir.clone(), source })?;
        for entry in entries {
            let entry = entry.map_err(|source| ManifestError::Read { path: dir.clone(), source })?;
            let p = entry.path();
            let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
            if hidden {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json")) {
                files.push(p);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(ManifestError::Empty { path: path.to_path_buf() });
    }
    Ok(files)
}

/// Loads every object under `path`.
pub fn load(path: &Path) -> Result<Manifests, ManifestError> {
    let mut out = Manifests::default();
    for file in manifest_files(path)? {
        let text =
            std::fs::read_to_string(&file).map_err(|source| ManifestError::Read { path: file.clone(), source })?;
        load_text(&file, &text, &mut out);
        out.files.push(file);
    }
    Ok(out)
}

/// Loads the objects of one file's text.
pub fn load_text(file: &Path, text: &str, out: &mut Manifests) {
    for (index, doc) in documents(file, text, out) {
        match doc {
            Value::Null => {}
            Value::Object(_) => add_object(file, &format!("document {index}"), doc, out),
            _ => out.problems.push(ManifestProblem {
                file: file.to_path_buf(),
                position: format!("document {index}"),
                name: None,
                reason: "not a Kubernetes object (expected a mapping)".into(),
            }),
        }
    }
}

/// YAML as Kubernetes reads it: only `true`/`false` are booleans (a Node named `n` or `on` stays
/// a string), and numbers with leading zeros or underscores stay strings in untyped values.
fn yaml_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.leading_zero_numbers_as_strings = true;
    options.underscored_numbers_as_strings = true;
    options
}

/// Parses YAML documents; a syntax error in one document does not lose the others.
fn documents(file: &Path, text: &str, out: &mut Manifests) -> Vec<(usize, Value)> {
    if let Ok(docs) = serde_saphyr::from_multiple_with_options::<Value>(text, yaml_options()) {
        return docs.into_iter().enumerate().collect();
    }
    // Re-parse document by document to find (and skip) the broken ones.
    let mut docs = Vec::new();
    for (index, chunk) in split_documents(text).into_iter().enumerate() {
        if chunk.trim().is_empty() {
            continue;
        }
        match serde_saphyr::from_str_with_options::<Value>(&chunk, yaml_options()) {
            Ok(v) => docs.push((index, v)),
            Err(e) => out.problems.push(ManifestProblem {
                file: file.to_path_buf(),
                position: format!("document {index}"),
                name: None,
                reason: format!("not valid YAML/JSON: {}", first_line(&e.to_string())),
            }),
        }
    }
    docs
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

fn split_documents(text: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    for line in text.lines() {
        if line.starts_with("---") {
            out.push(String::new());
            continue;
        }
        if let Some(current) = out.last_mut() {
            current.push_str(line);
            current.push('\n');
        }
    }
    out
}

fn object_name(v: &Value) -> Option<String> {
    let meta = v.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    Some(match meta.get("namespace").and_then(Value::as_str) {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    })
}

fn add_object(file: &Path, position: &str, v: Value, out: &mut Manifests) {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
    let name = object_name(&v);
    let problem = |reason: String| ManifestProblem {
        file: file.to_path_buf(),
        position: position.to_string(),
        name: name.clone(),
        reason,
    };
    if kind == "List" || kind.ends_with("List") {
        match v.get("items") {
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    add_object(file, &format!("{position} item {i}"), item.clone(), out);
                }
            }
            Some(Value::Null) | None => {}
            Some(_) => out.problems.push(problem("`items` is not a list".into())),
        }
        return;
    }
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => match serde_path_to_error::deserialize::<_, Service>(v) {
            Ok(s) => out.services.push(s),
            Err(e) => out.problems.push(problem(format!("invalid Service: {}: {}", e.path(), e.inner()))),
        },
        ("discovery.k8s.io/v1", "EndpointSlice") => match serde_path_to_error::deserialize::<_, EndpointSlice>(v) {
            Ok(s) => out.slices.push(s),
            Err(e) => out.problems.push(problem(format!("invalid EndpointSlice: {}: {}", e.path(), e.inner()))),
        },
        ("v1", "Node") => match serde_path_to_error::deserialize::<_, Node>(v) {
            Ok(n) => out.nodes.push(n),
            Err(e) => out.problems.push(problem(format!("invalid Node: {}: {}", e.path(), e.inner()))),
        },
        ("", _) | (_, "") => out.problems.push(problem("missing apiVersion or kind".into())),
        (api, k) => {
            tracing::debug!(file = %file.display(), position, kind = k, api_version = api, "ignoring object of another kind");
            out.ignored += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Manifests {
        let mut m = Manifests::default();
        load_text(Path::new("test.yaml"), text, &mut m);
        m
    }

    #[test]
    fn multi_document_yaml_and_lists() {
        let m = load_str(
            r#"
apiVersion: v1
kind: Service
metadata: {name: a, namespace: ns}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: v1
kind: List
items:
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1, namespace: ns, labels: {kubernetes.io/service-name: a}}
  addressType: IPv4
  endpoints: [{addresses: ["10.0.0.1"]}]
- apiVersion: v1
  kind: Node
  metadata: {name: node1}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: cm}
"#,
        );
        assert_eq!((m.services.len(), m.slices.len(), m.nodes.len(), m.ignored), (1, 1, 1, 1));
        assert!(m.problems.is_empty(), "{:?}", m.problems);
    }

    #[test]
    fn malformed_objects_are_reported_and_skipped() {
        let m = load_str(
            r#"
apiVersion: v1
kind: Service
metadata: {name: good, namespace: ns}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: ns}
spec: {ports: [{port: "eighty"}]}
---
kind: Service
metadata: {name: nover}
---
- just a list
---
apiVersion: v1
kind: Service
metadata: {name: also-good, namespace: ns}
spec: {clusterIP: 10.96.0.2, ports: [{port: 81}]}
"#,
        );
        assert_eq!(m.services.len(), 2);
        assert_eq!(m.problems.len(), 3, "{:#?}", m.problems);
        assert_eq!(m.problems[0].name.as_deref(), Some("ns/bad"));
        assert_eq!(m.problems[0].position, "document 1");
        assert!(m.problems[0].to_string().contains("test.yaml document 1 (ns/bad): invalid Service"));
    }

    #[test]
    fn a_yaml_syntax_error_loses_only_its_document() {
        let m = load_str(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\nkind: [unclosed\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n}\n",
        );
        assert_eq!(m.services.len(), 1);
        assert_eq!(m.nodes.len(), 1, "{:#?}", m.problems);
        assert_eq!(m.problems.len(), 1);
        assert!(m.problems[0].reason.starts_with("not valid YAML"));
    }
}
