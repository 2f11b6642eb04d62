//! Raw `getsockopt`/`setsockopt` with byte buffers, for the x_tables interface of
//! iptables-legacy ([`super::xtables`]), whose requests and replies are C structs the kernel
//! reads and writes in place.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// `getsockopt(fd, level, name)` into `buf` (which also carries the request, as x_tables
/// requests do); returns the length the kernel wrote.
pub(crate) fn get(fd: &OwnedFd, level: i32, name: i32, buf: &mut [u8]) -> io::Result<usize> {
    let mut len = libc::socklen_t::try_from(buf.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `buf` is a valid, writable buffer of `len` bytes for the whole call, `len` is a
    // valid socklen_t the kernel updates in place, and `fd` is an open socket we own.
    let rc = unsafe { libc::getsockopt(fd.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &raw mut len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(len as usize)
}

/// `setsockopt(fd, level, name, buf)`.
pub(crate) fn set(fd: &OwnedFd, level: i32, name: i32, buf: &[u8]) -> io::Result<()> {
    let len = libc::socklen_t::try_from(buf.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `buf` is a valid, readable buffer of `len` bytes for the whole call (the kernel
    // copies it, and writes old counters only through the user pointer the request carries,
    // which points into a buffer the caller keeps alive), and `fd` is an open socket we own.
    let rc = unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, buf.as_ptr().cast(), len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
