//! What `check` reads besides nftables: who holds an owned table's netlink socket, and whether
//! iptables-legacy tables are loaded. Both come from `/proc` of the current network namespace;
//! nothing here runs a program.

use std::collections::BTreeMap;
use std::fs;

/// A process holding a netlink socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Process {
    pub pid: u32,
    /// Its `/proc/PID/comm`.
    pub comm: String,
    /// The file name of its executable (`/proc/PID/exe`), where it could be read: nftproxy
    /// started as `/usr/local/bin/kube-proxy` (the image swap) is `kube-proxy` by comm and
    /// `nftproxy` by executable.
    pub exe: Option<String>,
}

impl Process {
    /// Whether it is an nftproxy (under any name).
    pub(crate) fn is_nftproxy(&self) -> bool {
        self.comm == "nftproxy" || self.exe.as_deref() == Some("nftproxy")
    }
}

/// `NETLINK_NETFILTER`, the protocol column of `/proc/net/netlink`.
const NETLINK_NETFILTER: u32 = 12;

/// The processes holding the netfilter netlink sockets with these port ids, where found.
///
/// The kernel names a table's owner by netlink port id, which is a pid only for a process's
/// first socket; so the socket is looked up in `/proc/net/netlink` by port id, and its inode in
/// the processes' open files.
pub(crate) fn netlink_owners(ports: &[u32]) -> BTreeMap<u32, Process> {
    let mut out = BTreeMap::new();
    if ports.is_empty() {
        return out;
    }
    let Ok(table) = fs::read_to_string("/proc/net/netlink") else { return out };
    let inodes: BTreeMap<u64, u32> = parse_netlink_sockets(&table)
        .into_iter()
        .filter(|(protocol, port, _)| *protocol == NETLINK_NETFILTER && ports.contains(port))
        .map(|(_, port, inode)| (inode, port))
        .collect();
    if inodes.is_empty() {
        return out;
    }
    let Ok(procs) = fs::read_dir("/proc") else { return out };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        // Processes come and go while we look; whatever cannot be read is skipped.
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = fs::read_link(fd.path()) else { continue };
            let Some(port) = socket_inode(&target.to_string_lossy()).and_then(|i| inodes.get(&i)) else { continue };
            let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default().trim().to_string();
            let exe = fs::read_link(entry.path().join("exe"))
                .ok()
                .and_then(|e| e.file_name().map(|n| n.to_string_lossy().into_owned()));
            out.entry(*port).or_insert(Process { pid, comm, exe });
        }
    }
    out
}

/// (protocol, port id, inode) of each socket in `/proc/net/netlink`.
fn parse_netlink_sockets(text: &str) -> Vec<(u32, u32, u64)> {
    // Columns: sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            Some((cols.get(1)?.parse().ok()?, cols.get(2)?.parse().ok()?, cols.get(9)?.parse().ok()?))
        })
        .collect()
}

/// The inode of a `socket:[12345]` link.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// iptables-legacy (x_tables) tables registered in this network namespace: `nat`, `filter`, …
/// for IPv4 and `ip6 nat`, … for IPv6. Empty when the modules are not loaded.
pub(crate) fn legacy_iptables() -> Vec<String> {
    let mut out = Vec::new();
    for (file, prefix) in [("/proc/net/ip_tables_names", ""), ("/proc/net/ip6_tables_names", "ip6 ")] {
        if let Ok(text) = fs::read_to_string(file) {
            out.extend(text.split_whitespace().map(|t| format!("{prefix}{t}")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_netlink_socket_table() {
        let text = "sk               Eth Pid        Groups   Rmem     Wmem     Dump  Locks    Drops    Inode\n\
                    ffff8880 0   897        00000000 0        0        0     2        0        17017\n\
                    ffff8881 12  4294962107 00000000 0        0        0     2        0        99\n";
        assert_eq!(parse_netlink_sockets(text), vec![(0, 897, 17017), (12, 4294962107, 99)]);
        assert_eq!(socket_inode("socket:[99]"), Some(99));
        assert_eq!(socket_inode("pipe:[99]"), None);
    }
}
