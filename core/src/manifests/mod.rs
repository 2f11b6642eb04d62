//! Services, EndpointSlices, Nodes and ServiceCIDRs from YAML or JSON files: one file or a
//! directory of them, multi-document YAML, and `kind: List` (what `kubectl get svc,endpointslices,nodes -A -o yaml`
//! prints). Files are read document by document and each object is converted as soon as it is
//! parsed, items of a List one at a time: only the model's values are kept, so memory follows
//! the cluster, not the size of the text. A malformed object is reported with its file,
//! position and name and skipped; the rest still loads.

use std::collections::HashSet;
use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use thiserror::Error;

use crate::index::{Change, Update};
use crate::model::{
    EndpointSliceInfo, NamespacedName, NodeInfo, ObjectKind, ObjectRef, Problem, ServiceCidrInfo, ServiceInfo, api,
    convert,
};

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

/// The objects found in manifests, converted, in file order.
#[derive(Debug, Default, Clone)]
pub struct Manifests {
    pub services: Vec<ServiceInfo>,
    pub slices: Vec<EndpointSliceInfo>,
    pub nodes: Vec<NodeInfo>,
    pub service_cidrs: Vec<ServiceCidrInfo>,
    /// Objects and fields that cannot be used (each skipped alone).
    pub object_problems: Vec<Problem>,
    /// Documents that are not usable objects.
    pub problems: Vec<ManifestProblem>,
    /// Objects of other kinds, ignored.
    pub ignored: usize,
    /// The files read.
    pub files: Vec<PathBuf>,
    /// Services defined so far (a later definition replaces an earlier one, reported).
    seen: HashSet<NamespacedName>,
}

impl Manifests {
    /// Complete lists of every kind as the index takes them (the node's only), and the problems
    /// of the objects.
    pub fn into_updates(self, hostname: &str) -> (Vec<Update>, Vec<Problem>) {
        let nodes = self.nodes.into_iter().filter(|n| n.name == hostname).collect();
        let updates = vec![
            Update::Service(Change::Reset(self.services)),
            Update::EndpointSlice(Change::Reset(self.slices)),
            Update::Node(Change::Reset(nodes)),
            Update::ServiceCidr(Change::Reset(self.service_cidrs)),
        ];
        (updates, self.object_problems)
    }

    /// How many objects and problems have been found so far.
    fn loaded(&self) -> usize {
        self.services.len()
            + self.slices.len()
            + self.nodes.len()
            + self.service_cidrs.len()
            + self.object_problems.len()
            + self.problems.len()
            + self.ignored
    }

    /// The cluster state these manifests describe for `hostname`, and the objects' problems.
    pub fn into_state(self, hostname: &str) -> (crate::model::ClusterState, Vec<Problem>) {
        let (updates, problems) = self.into_updates(hostname);
        let mut index = crate::index::ClusterIndex::new();
        for update in updates {
            index.apply(update);
        }
        (index.into_state(), problems)
    }

    fn add_service(&mut self, svc: &api::Service) {
        let converted = convert::service(svc);
        self.object_problems.extend(converted.problems);
        if let Some(info) = converted.value {
            if !self.seen.insert(info.name.clone()) {
                self.object_problems.push(Problem {
                    object: ObjectRef {
                        kind: ObjectKind::Service,
                        namespace: Some(info.name.namespace.clone()),
                        name: info.name.name.clone(),
                    },
                    field: String::new(),
                    reason: "defined more than once; the last definition wins".into(),
                    object_skipped: false,
                });
            }
            self.services.push(info);
        }
    }

    fn add_slice(&mut self, slice: &api::EndpointSlice) {
        let converted = convert::endpoint_slice(slice);
        self.object_problems.extend(converted.problems);
        self.slices.extend(converted.value);
    }

    fn add_node(&mut self, node: &api::Node) {
        let converted = convert::node(node);
        self.object_problems.extend(converted.problems);
        self.nodes.extend(converted.value);
    }

    fn add_service_cidr(&mut self, cidr: &api::ServiceCidr) {
        let converted = convert::service_cidr(cidr);
        self.object_problems.extend(converted.problems);
        self.service_cidrs.extend(converted.value);
    }
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
        let f = std::fs::File::open(&file).map_err(|source| ManifestError::Read { path: file.clone(), source })?;
        load_reader(&file, BufReader::with_capacity(256 * 1024, f), &mut out)
            .map_err(|source| ManifestError::Read { path: file.clone(), source })?;
        out.files.push(file);
    }
    Ok(out)
}

/// Loads the objects of one file's text.
pub fn load_text(file: &Path, text: &str, out: &mut Manifests) {
    // Reading from memory cannot fail.
    let _ = load_reader(file, text.as_bytes(), out);
}

/// Loads the objects of one file, document by document. A document's text is kept until it is
/// parsed, except a `kind: List` in block style (what kubectl prints), whose items are cut out
/// of it and parsed one at a time; a JSON document is parsed as it is read. So memory holds one
/// object's text at a time, whatever the size of the file.
fn load_reader(file: &Path, mut reader: impl BufRead, out: &mut Manifests) -> std::io::Result<()> {
    let mut index = 0;
    let mut line = Vec::new();
    loop {
        let mut doc = DocumentLines::new(file, index, out);
        let more = loop {
            line.clear();
            if reader.read_until(b'\n', &mut line)? == 0 {
                break false;
            }
            if line.starts_with(b"---") {
                break true;
            }
            doc.push(&String::from_utf8_lossy(&line));
        };
        doc.finish();
        if !more {
            return Ok(());
        }
        index += 1;
    }
}

/// The lines of one YAML document, with a kubectl-style List's items handed over one by one.
struct DocumentLines<'a> {
    context: Context<'a>,
    /// The document's text outside a List's items.
    text: String,
    /// Whether the document has had any line that is not blank or a comment.
    content: bool,
    list: ListState,
    item: String,
    items: usize,
    /// The document starts with `{`: JSON, or a YAML flow mapping.
    json: bool,
}

/// Where a document is with respect to a block `items:` sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListState {
    /// No top-level `items:` key seen (yet).
    None,
    /// Right after a top-level `items:` line: the next content line says whether a block
    /// sequence follows, and at which indentation.
    Expecting,
    /// Inside the sequence: items start with `- ` at this indentation, and the current item's
    /// content at the second column (from the first item line).
    In(usize, usize),
    /// After the sequence.
    Done,
}

fn indentation(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn blank_or_comment(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

impl<'a> DocumentLines<'a> {
    fn new(file: &'a Path, index: usize, out: &'a mut Manifests) -> DocumentLines<'a> {
        DocumentLines {
            context: Context { out, file, position: format!("document {index}") },
            text: String::new(),
            content: false,
            list: ListState::None,
            item: String::new(),
            items: 0,
            json: false,
        }
    }

    fn push(&mut self, line: &str) {
        let blank = blank_or_comment(line);
        if !self.content && !blank && line.trim_start().starts_with('{') {
            // JSON (or a YAML flow mapping): kept whole, see `finish`.
            self.json = true;
        }
        self.content |= !blank;
        if self.json {
            self.text.push_str(line);
            return;
        }
        if self.list == ListState::Expecting && !blank {
            let indent = indentation(line);
            if line[indent..].starts_with('-') {
                self.list = ListState::In(indent, indent + 2);
            } else {
                self.list = ListState::Done;
                self.text.push_str("items: []\n");
            }
        }
        if let ListState::In(indent, column) = self.list {
            let at = indentation(line);
            if !blank && at == indent && line[at..].starts_with('-') {
                // The next item: its content starts after `- ` (and any more spaces).
                self.flush_item();
                let after = &line[at + 1..];
                let column = at + 1 + (after.len() - after.trim_start_matches(' ').len());
                self.list = ListState::In(indent, column);
                self.item.push_str(&line[column.min(line.len())..]);
                if !self.item.ends_with('\n') {
                    self.item.push('\n');
                }
                return;
            }
            if !blank && at <= indent {
                // Back at the List's own level: the sequence is over.
                self.flush_item();
                self.list = ListState::Done;
            } else {
                self.item.push_str(&line[column.min(at)..]);
                return;
            }
        }
        if self.list == ListState::None && line.trim_end() == "items:" {
            self.list = ListState::Expecting;
            return;
        }
        self.text.push_str(line);
    }

    fn flush_item(&mut self) {
        if self.item.trim().is_empty() {
            self.item.clear();
            return;
        }
        let position = std::mem::take(&mut self.context.position);
        self.context.position = format!("{position} item {}", self.items);
        let item = std::mem::take(&mut self.item);
        self.context.yaml_object(&item);
        self.context.position = position;
        self.items += 1;
    }

    fn finish(mut self) {
        self.flush_item();
        if !self.content {
            return;
        }
        if self.json {
            let text = std::mem::take(&mut self.text);
            load_json(&text, &mut self.context);
            return;
        }
        if self.items == 0 && self.list != ListState::Done {
            // No List items were cut out: the whole text is one document.
            if self.list == ListState::Expecting {
                self.text.push_str("items: []\n");
            }
            let text = std::mem::take(&mut self.text);
            self.context.yaml_object(&text);
            return;
        }
        // A List: its own fields must say so.
        let header: Result<Value, _> = serde_yaml_ng::from_str(&self.text);
        let kind = header.as_ref().ok().and_then(|h| h.get("kind")).and_then(Value::as_str).unwrap_or("");
        if !(kind == "List" || kind.ends_with("List")) {
            let name = header.as_ref().ok().and_then(object_name);
            self.context.problem(name, "`items` outside a List: its items were read as objects".into());
        }
    }
}

/// Parses a document that starts with `{`: JSON, a List's items converted one by one as they
/// are parsed; or, when it is not JSON, YAML in flow style.
fn load_json(text: &str, context: &mut Context<'_>) {
    let before = context.out.loaded();
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = (DocumentSeed { context: &mut *context }).deserialize(&mut de).and_then(|()| de.end());
    match parsed {
        Ok(()) => {}
        // Nothing taken from it yet: read it as YAML.
        Err(_) if context.out.loaded() == before => context.yaml_object(text),
        Err(e) => context.problem(None, format!("not valid YAML/JSON: {}", first_line(&e.to_string()))),
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// Where objects of one document go.
struct Context<'a> {
    out: &'a mut Manifests,
    file: &'a Path,
    position: String,
}

/// A top-level `key: value` line of a block mapping (the value cut at a comment).
fn top_level<'t>(text: &'t str, key: &str) -> Option<&'t str> {
    text.lines().find_map(|l| {
        let v = l.strip_prefix(key)?.strip_prefix(':')?;
        let v = v.split(" #").next().unwrap_or(v).trim();
        Some(v.trim_matches(|c| c == '"' || c == '\''))
    })
}

impl Context<'_> {
    fn problem(&mut self, name: Option<String>, reason: String) {
        self.out.problems.push(ManifestProblem {
            file: self.file.to_path_buf(),
            position: self.position.clone(),
            name,
            reason,
        });
    }

    /// One object's YAML text. The kind is read off its top-level lines when it is written in
    /// block style (as kubectl prints), so the object is parsed straight into its type; any
    /// other shape goes through a value first.
    fn yaml_object(&mut self, text: &str) {
        let kind = top_level(text, "kind");
        let api_version = top_level(text, "apiVersion");
        let parsed = match (api_version, kind) {
            (Some("v1"), Some("Service")) => self.typed::<api::Service>(text, "Service", Manifests::add_service),
            (Some("discovery.k8s.io/v1"), Some("EndpointSlice")) => {
                self.typed::<api::EndpointSlice>(text, "EndpointSlice", Manifests::add_slice)
            }
            (Some("v1"), Some("Node")) => self.typed::<api::Node>(text, "Node", Manifests::add_node),
            (Some("networking.k8s.io/v1"), Some("ServiceCIDR")) => {
                self.typed::<api::ServiceCidr>(text, "ServiceCIDR", Manifests::add_service_cidr)
            }
            _ => None,
        };
        if parsed.is_some() {
            return;
        }
        match serde_yaml_ng::from_str::<Value>(text) {
            Ok(Value::Null) => {}
            Ok(v @ Value::Object(_)) => self.object(v),
            Ok(_) => self.problem(None, "not a Kubernetes object (expected a mapping)".into()),
            Err(e) => self.problem(None, format!("not valid YAML/JSON: {}", first_line(&e.to_string()))),
        }
    }

    /// Parses `text` as a `T` and adds it; `None` when the text is not valid YAML (the caller
    /// reports it through the general path).
    fn typed<T: serde::de::DeserializeOwned>(
        &mut self,
        text: &str,
        kind: &str,
        add: fn(&mut Manifests, &T),
    ) -> Option<()> {
        let de = serde_yaml_ng::Deserializer::from_str(text);
        match serde_path_to_error::deserialize::<_, T>(de) {
            Ok(object) => {
                add(self.out, &object);
                Some(())
            }
            Err(e) => {
                // A syntax error is reported as such by the general path.
                let value: Value = serde_yaml_ng::from_str(text).ok()?;
                let name = object_name(&value);
                self.problem(name, format!("invalid {kind}: {}: {}", e.path(), e.inner()));
                Some(())
            }
        }
    }

    /// One object (a document, or an item of a List) as a value.
    fn object(&mut self, v: Value) {
        let kind = v.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
        let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
        let name = object_name(&v);
        if kind == "List" || kind.ends_with("List") {
            match v.get("items") {
                Some(Value::Array(items)) => {
                    let position = self.position.clone();
                    for (i, item) in items.iter().enumerate() {
                        self.position = format!("{position} item {i}");
                        self.object(item.clone());
                    }
                    self.position = position;
                }
                Some(Value::Null) | None => {}
                Some(_) => self.problem(name, "`items` is not a list".into()),
            }
            return;
        }
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Service") => match serde_path_to_error::deserialize::<_, api::Service>(v) {
                Ok(s) => self.out.add_service(&s),
                Err(e) => self.problem(name, format!("invalid Service: {}: {}", e.path(), e.inner())),
            },
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                match serde_path_to_error::deserialize::<_, api::EndpointSlice>(v) {
                    Ok(s) => self.out.add_slice(&s),
                    Err(e) => self.problem(name, format!("invalid EndpointSlice: {}: {}", e.path(), e.inner())),
                }
            }
            ("v1", "Node") => match serde_path_to_error::deserialize::<_, api::Node>(v) {
                Ok(n) => self.out.add_node(&n),
                Err(e) => self.problem(name, format!("invalid Node: {}: {}", e.path(), e.inner())),
            },
            ("networking.k8s.io/v1", "ServiceCIDR") => {
                match serde_path_to_error::deserialize::<_, api::ServiceCidr>(v) {
                    Ok(c) => self.out.add_service_cidr(&c),
                    Err(e) => self.problem(name, format!("invalid ServiceCIDR: {}: {}", e.path(), e.inner())),
                }
            }
            ("", _) | (_, "") => self.problem(name, "missing apiVersion or kind".into()),
            (api, k) => {
                tracing::debug!(file = %self.file.display(), position = %self.position, kind = k, api_version = api, "ignoring object of another kind");
                self.out.ignored += 1;
            }
        }
    }
}

fn object_name(v: &Value) -> Option<String> {
    let meta = v.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    Some(match meta.get("namespace").and_then(Value::as_str) {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    })
}

/// A whole JSON document: a mapping is one object, except that its `items` sequence (a List)
/// is streamed, each item converted as soon as it is complete.
struct DocumentSeed<'c, 'a> {
    context: &'c mut Context<'a>,
}

impl<'de> DeserializeSeed<'de> for DocumentSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DocumentSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut fields = Map::new();
        let mut streamed = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "items" {
                let position = self.context.position.clone();
                let items = map.next_value_seed(ItemsSeed { context: &mut *self.context, position: &position })?;
                self.context.position = position;
                match items {
                    Some(v) => {
                        fields.insert(key, v);
                    }
                    None => streamed = true,
                }
            } else {
                fields.insert(key, map.next_value()?);
            }
        }
        let object = Value::Object(fields);
        let is_list = object.get("kind").and_then(Value::as_str).is_some_and(|k| k == "List" || k.ends_with("List"));
        if streamed && !is_list {
            self.context.problem(object_name(&object), "`items` outside a List: its items were read as objects".into());
        }
        if !streamed {
            self.context.object(object);
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        self.context.problem(None, "not a Kubernetes object (expected a mapping)".into());
        Ok(())
    }
}

/// A List's `items`: each element is parsed and converted before the next is read. Returns
/// `None` for a sequence (streamed), else the value.
struct ItemsSeed<'c, 'a, 'p> {
    context: &'c mut Context<'a>,
    position: &'p str,
}

impl<'de> DeserializeSeed<'de> for ItemsSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<Value>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemsSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Value>, A::Error> {
        let mut i = 0;
        while let Some(item) = seq.next_element::<Value>()? {
            self.context.position = format!("{} item {i}", self.position);
            match item {
                Value::Object(_) => self.context.object(item),
                _ => self.context.problem(None, "not a Kubernetes object (expected a mapping)".into()),
            }
            i += 1;
        }
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<Value>, E> {
        Ok(Some(Value::Null))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<Value>, A::Error> {
        Value::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Some)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Option<Value>, E> {
        Ok(Some(Value::String(v.to_string())))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Option<Value>, E> {
        Ok(Some(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Option<Value>, E> {
        Ok(Some(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Option<Value>, E> {
        Ok(Some(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Option<Value>, E> {
        Ok(Some(Value::from(v)))
    }
}

/// The cluster state loaded manifests describe, and the problems of their objects (`render`,
/// `sync`, tests).
pub fn state_from_manifests(m: &Manifests, hostname: &str) -> (crate::model::ClusterState, Vec<Problem>) {
    m.clone().into_state(hostname)
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
    fn service_cidrs_load_in_every_shape_and_bad_ones_are_reported() {
        let m = load_str(
            r#"
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec:
  cidrs: [10.96.0.0/16, "fd00:96::/112"]
---
{"apiVersion": "v1", "kind": "List", "items": [
  {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "extra"},
   "spec": {"cidrs": ["10.100.0.0/16", "10.98.0.0/16"]}},
  {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "broken"},
   "spec": {"cidrs": "10.99.0.0/16"}}]}
"#,
        );
        assert_eq!(m.service_cidrs.len(), 2, "{:?}", m.service_cidrs);
        assert_eq!(m.service_cidrs[1].cidrs, vec!["10.100.0.0/16".parse().unwrap()]);
        assert_eq!(m.object_problems.len(), 1, "{:?}", m.object_problems);
        assert_eq!(
            m.object_problems[0].to_string(),
            "ServiceCIDR extra: spec.cidrs[1] ignored: second IPv4 CIDR \"10.98.0.0/16\" (a ServiceCIDR holds one per family; first in spec.cidrs[0])"
        );
        assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
        assert!(m.problems[0].reason.starts_with("invalid ServiceCIDR: spec.cidrs"), "{:?}", m.problems);
        let (state, _) = m.into_state("node1");
        assert_eq!(state.service_cidrs(crate::net::IpFamily::V4).len(), 2);
    }

    #[test]
    fn lists_are_read_item_by_item_in_any_indentation_and_json() {
        let item = |ip: &str, name: &str| {
            format!(
                r#"apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: ns
spec:
  clusterIP: {ip}
  ports:
  - port: 80
"#
            )
        };
        let indented = |text: &str, by: usize| -> String {
            let pad = " ".repeat(by);
            let mut lines = text.lines();
            let first = lines.next().unwrap_or_default();
            let mut out = format!("{pad}- {first}\n");
            for l in lines {
                out.push_str(&format!("{pad}  {l}\n"));
            }
            out
        };
        // kubectl's layout (items at column 0, `kind: List` after them), and items indented.
        for by in [0, 2, 4] {
            let text = format!(
                r#"apiVersion: v1
items:
{}{}kind: List
metadata:
  resourceVersion: ""
"#,
                indented(&item("10.96.0.1", "a"), by),
                indented(&item("10.96.0.2", "b"), by)
            );
            let m = load_str(&text);
            assert!(m.problems.is_empty(), "{by}: {:?}", m.problems);
            let names: Vec<String> = m.services.iter().map(|s| s.name.to_string()).collect();
            assert_eq!(names, vec!["ns/a", "ns/b"], "{by}");
        }
        // JSON, as `kubectl get -o json` prints it.
        let json = r#"{"apiVersion": "v1", "items": [
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a", "namespace": "ns"},
             "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}},
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}}
        ], "kind": "List"}"#;
        let m = load_str(json);
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        assert_eq!((m.services.len(), m.nodes.len()), (1, 1));
    }

    #[test]
    fn a_broken_list_item_loses_only_itself() {
        let m = load_str(
            r#"apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a, namespace: ns}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: [unclosed
- apiVersion: v1
  kind: Service
  metadata: {name: c, namespace: ns}
  spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
"#,
        );
        let names: Vec<String> = m.services.iter().map(|s| s.name.to_string()).collect();
        assert_eq!(names, vec!["ns/a", "ns/c"]);
        assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
        assert_eq!(m.problems[0].position, "document 0 item 1");
        assert!(m.problems[0].reason.starts_with("not valid YAML"), "{}", m.problems[0]);
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
            r#"apiVersion: v1
kind: Service
metadata: {name: a, namespace: ns}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
kind: [unclosed
---
apiVersion: v1
kind: Node
metadata: {name: n}
"#,
        );
        assert_eq!(m.services.len(), 1);
        assert_eq!(m.nodes.len(), 1, "{:#?}", m.problems);
        assert_eq!(m.problems.len(), 1);
        assert!(m.problems[0].reason.starts_with("not valid YAML"));
    }
}
