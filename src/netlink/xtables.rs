//! iptables-legacy's tables: the kernel's x_tables (`ip_tables`, `ip6_tables`), which nf_tables
//! netlink cannot see. A kube-proxy that ran with the legacy backend (its image's
//! iptables-wrapper picks the backend with more rules) leaves its `KUBE-` chains and the jumps
//! to them there; upstream, starting in nftables mode, removes them with `iptables-legacy`, and
//! so does nftproxy's takeover, here, without a program.
//!
//! A table is read as userspace iptables reads it (`IPT_SO_GET_INFO`, `IPT_SO_GET_ENTRIES`) and
//! written back whole (`IPT_SO_SET_REPLACE`): the entries of the removed chains
//! and the removed jumps are left out, every jump offset and hook entry point is moved to where
//! its entry now sits, and the kernel checks the result as it checks iptables' own. If the table
//! changed between the read and the write (the kernel's entry count differs), the kernel refuses
//! with `EAGAIN` and the removal is read and tried again. Only tables listed in
//! `/proc/net/ip{,6}_tables_names` are read: asking for another would make the kernel create it.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::OwnedFd;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
use thiserror::Error;

use super::sockopt;
use crate::net::IpFamily;

/// The built-in chains by hook number (`NF_INET_PRE_ROUTING` … `NF_INET_POST_ROUTING`).
const HOOK_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// `XT_TABLE_MAXNAMELEN`.
const TABLE_NAME_LEN: usize = 32;
/// `struct xt_entry_target`'s header; a standard target's verdict, or an error target's name,
/// follows it.
const TARGET_HEADER: usize = 32;
/// The error target that names a user chain (its data is the chain's name), and ends the table.
const ERROR_TARGET: &str = "ERROR";

/// Errors reading or writing an x_tables table.
#[derive(Debug, Error)]
pub(crate) enum XtablesError {
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("{table}: malformed entry table: {detail}")]
    Malformed { table: String, detail: String },
}

/// Where `struct ipt_entry` and `struct ip6t_entry` differ (x86-64 and every other Linux ABI
/// with 4-byte `int` and 8-byte-aligned `u64`).
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// `target_offset`, then `next_offset` (both u16) at this offset of the entry.
    target_offset_at: usize,
    /// `SOL_IP` / `SOL_IPV6`.
    level: i32,
}

impl Layout {
    fn of(family: IpFamily) -> Layout {
        match family {
            IpFamily::V4 => Layout { target_offset_at: 88, level: libc::SOL_IP },
            IpFamily::V6 => Layout { target_offset_at: 140, level: libc::SOL_IPV6 },
        }
    }
}

/// `IPT_SO_GET_INFO` and `IP6T_SO_GET_INFO` (as `_SET_REPLACE`, on the other direction).
const SO_GET_INFO: i32 = 64;
const SO_GET_ENTRIES: i32 = 65;
const SO_SET_REPLACE: i32 = 64;
/// `struct ipt_getinfo`: name, valid_hooks, hook_entry[5], underflow[5], num_entries, size.
const GETINFO_LEN: usize = 84;
/// `struct ipt_get_entries`' header (name, size; the entries are 8-byte aligned after it).
const GET_ENTRIES_HEADER: usize = 40;
/// `struct ipt_replace`'s header, up to its entries.
const REPLACE_HEADER: usize = 96;
/// `struct xt_counters`.
const COUNTERS_LEN: usize = 16;

/// What an entry's target does.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// The standard target: a verdict (< 0) or a jump to the entry at this offset (>= 0).
    Standard(i32),
    /// The error target: a user chain's head (its name), or the table's end (`ERROR`).
    Error(String),
    /// An extension target (`DNAT`, `MASQUERADE`, `MARK`, …).
    Extension(String),
}

/// One entry of the table's blob.
#[derive(Debug, Clone)]
struct Entry {
    offset: usize,
    size: usize,
    target_offset: usize,
    target: Target,
}

/// A chain: its name, whether it is built in, and its entries (indexes into the table's
/// entries): a user chain's are its head, its rules and its `RETURN`; a built-in chain's are its
/// rules and its policy.
#[derive(Debug, Clone)]
struct Chain {
    name: String,
    builtin: bool,
    entries: std::ops::Range<usize>,
}

impl Chain {
    /// The indexes of its rules (what `iptables -L` numbers from 1).
    fn rules(&self) -> std::ops::Range<usize> {
        let start = if self.builtin { self.entries.start } else { self.entries.start + 1 };
        start..self.entries.end.saturating_sub(1).max(start)
    }
}

/// A rule as the takeover looks at it: its chain, its position there (from 1), and the user
/// chain it jumps (or goes) to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LegacyRule {
    pub chain: String,
    pub position: usize,
    pub jump: Option<String>,
}

/// One x_tables table as the kernel holds it.
#[derive(Debug, Clone)]
pub(crate) struct LegacyTable {
    pub family: IpFamily,
    pub name: String,
    valid_hooks: u32,
    hook_entry: [u32; 5],
    underflow: [u32; 5],
    blob: Vec<u8>,
    entries: Vec<Entry>,
    chains: Vec<Chain>,
}

/// The tables registered in this network namespace, per family (`/proc/net/ip_tables_names`).
pub(crate) fn loaded_tables(family: IpFamily) -> Vec<String> {
    let file = match family {
        IpFamily::V4 => "/proc/net/ip_tables_names",
        IpFamily::V6 => "/proc/net/ip6_tables_names",
    };
    std::fs::read_to_string(file).map(|t| t.split_whitespace().map(str::to_string).collect()).unwrap_or_default()
}

fn xtables_socket(family: IpFamily) -> Result<OwnedFd, XtablesError> {
    let domain = match family {
        IpFamily::V4 => AddressFamily::Inet,
        IpFamily::V6 => AddressFamily::Inet6,
    };
    // Any socket of the family reaches x_tables' socket options (the kernel passes them on to
    // netfilter by number); a datagram socket needs no CAP_NET_RAW, as iptables' raw one does.
    socket(domain, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| XtablesError::Io { what: "cannot open a socket for x_tables".into(), source: e.into() })
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A NUL-terminated name inside a fixed-size field.
fn name_at(b: &[u8], at: usize, len: usize) -> Option<String> {
    let field = b.get(at..at + len)?;
    let end = field.iter().position(|&c| c == 0).unwrap_or(field.len());
    Some(String::from_utf8_lossy(&field[..end]).into_owned())
}

impl LegacyTable {
    /// Reads a table registered in this network namespace (see [`loaded_tables`]).
    pub(crate) fn read(family: IpFamily, name: &str) -> Result<LegacyTable, XtablesError> {
        let fd = xtables_socket(family)?;
        LegacyTable::read_on(&fd, family, name)
    }

    fn read_on(fd: &OwnedFd, family: IpFamily, name: &str) -> Result<LegacyTable, XtablesError> {
        let layout = Layout::of(family);
        let io = |what: &str| {
            let what = format!("{what} of {} table {name}", family_name(family));
            move |source| XtablesError::Io { what, source }
        };
        let mut info = vec![0u8; GETINFO_LEN];
        info[..name.len().min(TABLE_NAME_LEN - 1)]
            .copy_from_slice(&name.as_bytes()[..name.len().min(TABLE_NAME_LEN - 1)]);
        sockopt::get(fd, layout.level, SO_GET_INFO, &mut info).map_err(io("reading the size"))?;
        let malformed = |detail: &str| XtablesError::Malformed { table: name.to_string(), detail: detail.to_string() };
        let field = |at| u32_at(&info, at).ok_or_else(|| malformed("short GET_INFO reply"));
        let valid_hooks = field(32)?;
        let mut hook_entry = [0u32; 5];
        let mut underflow = [0u32; 5];
        for h in 0..5 {
            hook_entry[h] = field(36 + 4 * h)?;
            underflow[h] = field(56 + 4 * h)?;
        }
        let size = field(80)? as usize;
        let mut request = vec![0u8; GET_ENTRIES_HEADER + size];
        request[..TABLE_NAME_LEN].copy_from_slice(&info[..TABLE_NAME_LEN]);
        request[32..36].copy_from_slice(&u32::try_from(size).unwrap_or(u32::MAX).to_ne_bytes());
        sockopt::get(fd, layout.level, SO_GET_ENTRIES, &mut request).map_err(io("reading the entries"))?;
        let blob = request.split_off(GET_ENTRIES_HEADER);
        LegacyTable::parse(family, name, valid_hooks, hook_entry, underflow, blob)
    }

    /// Splits a table's blob into entries and chains.
    fn parse(
        family: IpFamily,
        name: &str,
        valid_hooks: u32,
        hook_entry: [u32; 5],
        underflow: [u32; 5],
        blob: Vec<u8>,
    ) -> Result<LegacyTable, XtablesError> {
        let layout = Layout::of(family);
        let malformed = |detail: String| XtablesError::Malformed { table: name.to_string(), detail };
        let mut entries = Vec::new();
        let mut offset = 0;
        while offset < blob.len() {
            let target_offset = u16_at(&blob, offset + layout.target_offset_at)
                .ok_or_else(|| malformed(format!("entry at {offset} is cut short")))?
                as usize;
            let size = u16_at(&blob, offset + layout.target_offset_at + 2)
                .ok_or_else(|| malformed(format!("entry at {offset} is cut short")))? as usize;
            if size == 0 || target_offset + TARGET_HEADER > size || offset + size > blob.len() {
                return Err(malformed(format!("entry at {offset} has size {size}, target at {target_offset}")));
            }
            let t = offset + target_offset;
            let target_name = name_at(&blob, t + 2, 29).unwrap_or_default();
            let target = if target_name.is_empty() {
                let verdict = u32_at(&blob, t + TARGET_HEADER)
                    .ok_or_else(|| malformed(format!("standard target at {t} is cut short")))?;
                Target::Standard(i32::from_ne_bytes(verdict.to_ne_bytes()))
            } else if target_name == ERROR_TARGET {
                Target::Error(name_at(&blob, t + TARGET_HEADER, 30).unwrap_or_default())
            } else {
                Target::Extension(target_name)
            };
            entries.push(Entry { offset, size, target_offset, target });
            offset += size;
        }
        // Chains start at a hook's entry point or at a user chain's head; each runs to the next.
        let mut starts: Vec<(usize, String, bool)> = Vec::new();
        for (hook, chain) in HOOK_CHAINS.iter().enumerate() {
            if valid_hooks & (1 << hook) == 0 {
                continue;
            }
            let at = hook_entry[hook] as usize;
            let index = entries
                .iter()
                .position(|e| e.offset == at)
                .ok_or_else(|| malformed(format!("hook {chain} enters at {at}, no entry there")))?;
            starts.push((index, (*chain).to_string(), true));
        }
        for (index, e) in entries.iter().enumerate() {
            if let Target::Error(chain) = &e.target
                && chain != ERROR_TARGET
            {
                starts.push((index, chain.clone(), false));
            }
        }
        starts.sort();
        let end_marker = entries
            .iter()
            .rposition(|e| matches!(&e.target, Target::Error(n) if n == ERROR_TARGET))
            .ok_or_else(|| malformed("no end marker".into()))?;
        let mut chains = Vec::new();
        for (i, (start, chain, builtin)) in starts.iter().enumerate() {
            let end = starts.get(i + 1).map_or(end_marker, |s| s.0);
            chains.push(Chain { name: chain.clone(), builtin: *builtin, entries: *start..end });
        }
        Ok(LegacyTable { family, name: name.to_string(), valid_hooks, hook_entry, underflow, blob, entries, chains })
    }

    /// The user chains' names.
    pub(crate) fn user_chains(&self) -> Vec<&str> {
        self.chains.iter().filter(|c| !c.builtin).map(|c| c.name.as_str()).collect()
    }

    /// The built-in chains' names.
    pub(crate) fn builtin_chains(&self) -> Vec<&str> {
        self.chains.iter().filter(|c| c.builtin).map(|c| c.name.as_str()).collect()
    }

    /// The user chain whose first rule (or `RETURN`) is at this offset: where a jump lands.
    fn chain_entered_at(&self, offset: usize) -> Option<&str> {
        self.chains.iter().filter(|c| !c.builtin).find_map(|c| {
            let first = self.entries.get(c.entries.start + 1)?;
            (first.offset == offset).then_some(c.name.as_str())
        })
    }

    /// Every rule, with the user chain it jumps to.
    pub(crate) fn rules(&self) -> Vec<LegacyRule> {
        let mut out = Vec::new();
        for chain in &self.chains {
            for (i, index) in chain.rules().enumerate() {
                let jump = match self.entries[index].target {
                    Target::Standard(v) if v >= 0 => usize::try_from(v).ok().and_then(|o| self.chain_entered_at(o)),
                    _ => None,
                };
                out.push(LegacyRule { chain: chain.name.clone(), position: i + 1, jump: jump.map(str::to_string) });
            }
        }
        out
    }

    /// The table without the user chains `chains` (head, rules, `RETURN`) and the rules
    /// `drop` names (chain, position from 1), as a `SET_REPLACE` request's parts: the new
    /// entry blob, its entry count, and the hooks' entry points and policies moved.
    fn without(
        &self,
        chains: &BTreeSet<String>,
        drop: &BTreeSet<(String, usize)>,
    ) -> Result<Replacement, XtablesError> {
        let malformed = |detail: String| XtablesError::Malformed { table: self.name.clone(), detail };
        let mut removed = vec![false; self.entries.len()];
        for chain in &self.chains {
            if !chain.builtin && chains.contains(&chain.name) {
                removed[chain.entries.clone()].iter_mut().for_each(|r| *r = true);
            }
            for (i, index) in chain.rules().enumerate() {
                if drop.contains(&(chain.name.clone(), i + 1)) {
                    removed[index] = true;
                }
            }
        }
        // Old offset -> new offset of the first entry kept at or after it.
        let mut moved: BTreeMap<usize, usize> = BTreeMap::new();
        let mut new_offset = 0;
        for (e, gone) in self.entries.iter().zip(&removed) {
            moved.insert(e.offset, new_offset);
            if !gone {
                new_offset += e.size;
            }
        }
        moved.insert(self.blob.len(), new_offset);
        let mut blob = Vec::with_capacity(new_offset);
        let mut count = 0u32;
        for (e, gone) in self.entries.iter().zip(&removed) {
            if *gone {
                continue;
            }
            let mut bytes = self.blob[e.offset..e.offset + e.size].to_vec();
            if let Target::Standard(v) = e.target
                && v >= 0
            {
                let target = usize::try_from(v).unwrap_or(usize::MAX);
                let landing =
                    self.entries.iter().position(|x| x.offset == target).ok_or_else(|| {
                        malformed(format!("a jump at {} lands at {target}, no entry there", e.offset))
                    })?;
                if removed[landing] {
                    return Err(malformed(format!(
                        "the rule at {} jumps into a removed chain ({})",
                        e.offset,
                        self.chain_entered_at(target).unwrap_or("?")
                    )));
                }
                let new = u32::try_from(moved[&target]).map_err(|_| malformed("table too large".into()))?;
                let at = e.target_offset + TARGET_HEADER;
                bytes[at..at + 4].copy_from_slice(&new.to_ne_bytes());
            }
            blob.extend_from_slice(&bytes);
            count += 1;
        }
        let mut hook_entry = self.hook_entry;
        let mut underflow = self.underflow;
        for h in 0..5 {
            if self.valid_hooks & (1 << h) == 0 {
                continue;
            }
            let (entry, policy) = (self.hook_entry[h] as usize, self.underflow[h] as usize);
            let moved_to = |old: usize| moved.range(old..).next().map(|(_, n)| *n);
            hook_entry[h] =
                u32::try_from(moved_to(entry).ok_or_else(|| malformed(format!("hook {h} enters past the end")))?)
                    .unwrap_or(u32::MAX);
            underflow[h] =
                u32::try_from(moved_to(policy).ok_or_else(|| malformed(format!("hook {h}'s policy past the end")))?)
                    .unwrap_or(u32::MAX);
        }
        Ok(Replacement { blob, num_entries: count, hook_entry, underflow })
    }

    /// Writes `replacement` in place of this table (which must still be what the kernel holds:
    /// the kernel refuses with `EAGAIN` when its entry count differs).
    fn replace(&self, fd: &OwnedFd, replacement: &Replacement) -> io::Result<()> {
        let layout = Layout::of(self.family);
        let old_entries = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        let mut request = vec![0u8; REPLACE_HEADER + replacement.blob.len()];
        let name = self.name.as_bytes();
        request[..name.len().min(TABLE_NAME_LEN - 1)].copy_from_slice(&name[..name.len().min(TABLE_NAME_LEN - 1)]);
        request[32..36].copy_from_slice(&self.valid_hooks.to_ne_bytes());
        request[36..40].copy_from_slice(&replacement.num_entries.to_ne_bytes());
        let size = u32::try_from(replacement.blob.len()).unwrap_or(u32::MAX);
        request[40..44].copy_from_slice(&size.to_ne_bytes());
        for h in 0..5 {
            request[44 + 4 * h..48 + 4 * h].copy_from_slice(&replacement.hook_entry[h].to_ne_bytes());
            request[64 + 4 * h..68 + 4 * h].copy_from_slice(&replacement.underflow[h].to_ne_bytes());
        }
        request[84..88].copy_from_slice(&old_entries.to_ne_bytes());
        request[REPLACE_HEADER..].copy_from_slice(&replacement.blob);
        // The kernel writes the old entries' counters through the pointer at byte 88.
        let counters = self.entries.len() * COUNTERS_LEN;
        sockopt::set_with_output(fd, layout.level, SO_SET_REPLACE, &mut request, 88, counters).map(|_| ())
    }
}

/// A table's new contents, for `SET_REPLACE`.
#[derive(Debug, Clone)]
struct Replacement {
    blob: Vec<u8>,
    num_entries: u32,
    hook_entry: [u32; 5],
    underflow: [u32; 5],
}

/// What [`remove`] takes out of one table: user chains, and rules of other chains by position.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Removal {
    pub chains: BTreeSet<String>,
    pub rules: BTreeSet<(String, usize)>,
}

/// Removes what `decide` picks from the table, reading it again and retrying (three times) when
/// something else changed it in between. `decide` sees the table as read each time.
pub(crate) fn remove(
    family: IpFamily,
    name: &str,
    decide: impl Fn(&LegacyTable) -> Removal,
) -> Result<Removal, XtablesError> {
    let fd = xtables_socket(family)?;
    let _lock = XtablesLock::acquire(family)?;
    let mut attempt = 0;
    loop {
        // The table can change between its size and its entries being read: read again.
        let table = match LegacyTable::read_on(&fd, family, name) {
            Err(XtablesError::Io { source, .. }) if source.raw_os_error() == Some(libc::EAGAIN) && attempt < 3 => {
                attempt += 1;
                continue;
            }
            read => read?,
        };
        let removal = decide(&table);
        if removal.chains.is_empty() && removal.rules.is_empty() {
            return Ok(removal);
        }
        let replacement = table.without(&removal.chains, &removal.rules)?;
        match table.replace(&fd, &replacement) {
            Ok(()) => return Ok(removal),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && attempt < 3 => attempt += 1,
            Err(source) => {
                return Err(XtablesError::Io {
                    what: format!("writing {} table {name} back", family_name(family)),
                    source,
                });
            }
        }
    }
}

fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables-legacy",
        IpFamily::V6 => "ip6tables-legacy",
    }
}

/// iptables' own lock (`/run/xtables.lock`, held by every iptables-legacy writer), taken for
/// the write where the file exists (nftproxy's DaemonSet and kube-proxy's mount the node's).
/// The kernel refuses a stale replace only when the entry count changed, so a write without
/// the lock could undo another writer's change of the same size.
struct XtablesLock {
    _file: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl XtablesLock {
    /// The lock, or nothing where there is no lock file; an error when another writer holds
    /// it for more than 5 s (the leftovers then stay, logged, and `nftproxy check` reports
    /// them with the commands that remove them).
    fn acquire(family: IpFamily) -> Result<XtablesLock, XtablesError> {
        let Ok(file) = std::fs::OpenOptions::new().read(true).write(true).open("/run/xtables.lock") else {
            return Ok(XtablesLock { _file: None });
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut file = file;
        loop {
            match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Ok(XtablesLock { _file: Some(lock) }),
                Err((f, _)) if std::time::Instant::now() < deadline => {
                    file = f;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err((_, errno)) => {
                    return Err(XtablesError::Io {
                        what: format!(
                            "{}: /run/xtables.lock held by another writer for more than 5 s",
                            family_name(family)
                        ),
                        source: io::Error::from(errno),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `XT_RETURN`: the verdict of a user chain's last entry.
    const RETURN: i32 = -5;

    /// An IPv4 entry with a standard target (a verdict or a jump), a chain head, or a named
    /// target.
    fn entry(target: &Target) -> Vec<u8> {
        const ENTRY: usize = 112;
        let (target_len, data): (usize, Vec<u8>) = match target {
            Target::Standard(v) => (40, v.to_ne_bytes().to_vec()),
            Target::Error(name) => (64, name.as_bytes().to_vec()),
            Target::Extension(_) => (40, vec![0; 8]),
        };
        let mut b = vec![0u8; ENTRY + target_len];
        b[88..90].copy_from_slice(&(ENTRY as u16).to_ne_bytes());
        b[90..92].copy_from_slice(&((ENTRY + target_len) as u16).to_ne_bytes());
        b[ENTRY..ENTRY + 2].copy_from_slice(&(target_len as u16).to_ne_bytes());
        let name = match target {
            Target::Standard(_) => "",
            Target::Error(_) => ERROR_TARGET,
            Target::Extension(n) => n.as_str(),
        };
        b[ENTRY + 2..ENTRY + 2 + name.len()].copy_from_slice(name.as_bytes());
        b[ENTRY + TARGET_HEADER..ENTRY + TARGET_HEADER + data.len()].copy_from_slice(&data);
        b
    }

    /// A nat table: PREROUTING (jump KUBE-SERVICES; accept), OUTPUT (jump KUBE-SERVICES;
    /// accept), KUBE-SERVICES (DNAT; return), KEEP (return), the end marker.
    fn nat_table() -> LegacyTable {
        // Offsets: each standard/extension entry is 152 bytes, an error entry 176.
        let std = 152usize;
        let err = 176usize;
        let prerouting = 0;
        let output = prerouting + 2 * std;
        let kube = output + 2 * std; // the head of KUBE-SERVICES
        let kube_first = kube + err;
        let keep = kube_first + 2 * std;
        let keep_first = keep + err;
        let end = keep_first + std;
        let v = |o: usize| i32::try_from(o).unwrap();
        let mut blob = Vec::new();
        blob.extend(entry(&Target::Standard(v(kube_first))));
        blob.extend(entry(&Target::Standard(-2)));
        blob.extend(entry(&Target::Standard(v(kube_first))));
        blob.extend(entry(&Target::Standard(-2)));
        blob.extend(entry(&Target::Error("KUBE-SERVICES".into())));
        blob.extend(entry(&Target::Extension("DNAT".into())));
        blob.extend(entry(&Target::Standard(RETURN)));
        blob.extend(entry(&Target::Error("KEEP".into())));
        blob.extend(entry(&Target::Standard(RETURN)));
        blob.extend(entry(&Target::Error(ERROR_TARGET.into())));
        assert_eq!(blob.len(), end + err);
        // PREROUTING = hook 0, OUTPUT = hook 3.
        let hooks = (1 << 0) | (1 << 3);
        let mut hook_entry = [0u32; 5];
        let mut underflow = [0u32; 5];
        hook_entry[0] = u32::try_from(prerouting).unwrap();
        underflow[0] = u32::try_from(prerouting + std).unwrap();
        hook_entry[3] = u32::try_from(output).unwrap();
        underflow[3] = u32::try_from(output + std).unwrap();
        LegacyTable::parse(IpFamily::V4, "nat", hooks, hook_entry, underflow, blob).unwrap()
    }

    #[test]
    fn chains_and_jumps_are_read_from_the_blob() {
        let table = nat_table();
        assert_eq!(table.builtin_chains(), ["PREROUTING", "OUTPUT"]);
        assert_eq!(table.user_chains(), ["KUBE-SERVICES", "KEEP"]);
        let rules = table.rules();
        let jumps: Vec<(&str, usize, Option<&str>)> =
            rules.iter().map(|r| (r.chain.as_str(), r.position, r.jump.as_deref())).collect();
        assert_eq!(
            jumps,
            [
                ("PREROUTING", 1, Some("KUBE-SERVICES")),
                ("OUTPUT", 1, Some("KUBE-SERVICES")),
                ("KUBE-SERVICES", 1, None)
            ]
        );
    }

    #[test]
    fn removing_a_chain_and_its_jumps_moves_every_offset() {
        let table = nat_table();
        let chains = BTreeSet::from(["KUBE-SERVICES".to_string()]);
        let rules = BTreeSet::from([("PREROUTING".to_string(), 1), ("OUTPUT".to_string(), 1)]);
        let r = table.without(&chains, &rules).unwrap();
        // Left: PREROUTING's policy, OUTPUT's policy, KEEP's head and return, the end marker.
        assert_eq!(r.num_entries, 5);
        assert_eq!((r.hook_entry[0], r.underflow[0]), (0, 0));
        assert_eq!((r.hook_entry[3], r.underflow[3]), (152, 152));
        let again =
            LegacyTable::parse(IpFamily::V4, "nat", table.valid_hooks, r.hook_entry, r.underflow, r.blob).unwrap();
        assert_eq!(again.user_chains(), ["KEEP"]);
        assert!(again.rules().is_empty());
    }

    #[test]
    fn a_jump_into_a_removed_chain_that_is_not_removed_too_is_refused() {
        let table = nat_table();
        let chains = BTreeSet::from(["KUBE-SERVICES".to_string()]);
        let err = table.without(&chains, &BTreeSet::new()).unwrap_err();
        assert!(err.to_string().contains("jumps into a removed chain (KUBE-SERVICES)"), "{err}");
    }

    #[test]
    fn a_kept_jump_lands_where_its_chain_moved() {
        let table = nat_table();
        // Remove PREROUTING's jump only: OUTPUT's jump must land on KUBE-SERVICES' new place.
        let rules = BTreeSet::from([("PREROUTING".to_string(), 1)]);
        let r = table.without(&BTreeSet::new(), &rules).unwrap();
        let again =
            LegacyTable::parse(IpFamily::V4, "nat", table.valid_hooks, r.hook_entry, r.underflow, r.blob).unwrap();
        let jumps: Vec<(String, Option<String>)> = again.rules().into_iter().map(|r| (r.chain, r.jump)).collect();
        assert_eq!(jumps, [("OUTPUT".into(), Some("KUBE-SERVICES".into())), ("KUBE-SERVICES".into(), None)]);
    }
}
