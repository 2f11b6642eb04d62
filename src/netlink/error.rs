//! The kernel edge's errors, and the kernel's refusal of one message of a transaction.

use std::io;

use thiserror::Error;

use crate::nft::ast::Owner;
use crate::nft::diff::OpTag;

/// Errors from the kernel edge.
#[derive(Debug, Error)]
pub enum NetlinkError {
    #[error("cannot open a netfilter netlink socket: {0} (nftproxy needs CAP_NET_ADMIN)")]
    Socket(#[source] io::Error),
    #[error("sending the batch failed: {0}")]
    Send(#[source] io::Error),
    #[error("reading kernel replies failed: {0}")]
    Receive(#[source] io::Error),
    #[error("kernel replies were lost (receive buffer overrun); the outcome of the transaction is unknown")]
    RepliesLost,
    #[error("the kernel did not confirm the commit (no ACK for BATCH_END)")]
    NotCommitted,
    #[error("reading the ruleset failed: {0}")]
    Dump(#[source] io::Error),
    #[error("malformed netlink message: {0}")]
    Malformed(&'static str),
    #[error("out of memory in libnftnl")]
    OutOfMemory,
    #[error("name {0:?} contains a NUL byte")]
    InvalidName(String),
    #[error("the batch needs {pages} pages, more than one sendmsg can carry")]
    BatchTooLarge { pages: usize },
    #[error("cannot encode foreign expression {0:?}")]
    ForeignExpression(String),
    #[error(
        "table {table} is owned by another process (netlink port {port}): a second nftproxy, or a tool run with \
         `flags owner`; `nftproxy check` names it"
    )]
    OwnedElsewhere { table: String, port: u32 },
    #[error("cannot receive nftables trace events: {0} (this needs CAP_NET_ADMIN in the network namespace)")]
    Subscribe(#[source] io::Error),
    #[error("cannot create the trace table {table}: {source}")]
    TraceTable {
        table: String,
        #[source]
        source: io::Error,
    },
    #[error("the kernel rejected the transaction: {}", describe(.0))]
    Rejected(Vec<MessageFailure>),
    #[error("another transaction committed since the generation the batch expected; nothing was applied")]
    GenerationChanged,
}

fn describe(failures: &[MessageFailure]) -> String {
    failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; ")
}

/// One message the kernel refused, and whom it was for.
#[derive(Debug, Clone)]
pub struct MessageFailure {
    /// Index of the operation in the transaction.
    pub op_index: usize,
    /// What the operation does.
    pub tag: OpTag,
    /// The operation, as text (`add rule ip nftproxy services`).
    pub op: String,
    /// Positive errno.
    pub errno: i32,
    /// The owners this failure points at (one element, or the operation's owner).
    pub owners: Vec<Owner>,
    /// Kernel error text, if any.
    pub text: Option<String>,
}

impl std::fmt::Display for MessageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let err = io::Error::from_raw_os_error(self.errno);
        let owners: Vec<String> = self.owners.iter().map(|o| o.to_string()).collect();
        write!(f, "{} failed for {}: {err}", self.op, owners.join(", "))?;
        if let Some(t) = &self.text {
            write!(f, " ({t})")?;
        }
        Ok(())
    }
}
