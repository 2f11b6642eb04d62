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

/// `setsockopt(fd, level, name, request)` for an option whose request carries, at byte
/// `pointer_at`, a pointer the kernel writes `out_len` bytes through (x_tables'
/// `SO_SET_REPLACE`: the old entries' counters). The pointer is set here, to a buffer that
/// outlives the call; what the kernel wrote there is returned.
pub(crate) fn set_with_output(
    fd: &OwnedFd,
    level: i32,
    name: i32,
    request: &mut [u8],
    pointer_at: usize,
    out_len: usize,
) -> io::Result<Vec<u8>> {
    let mut out = vec![0u8; out_len];
    let pointer = (out.as_mut_ptr() as usize as u64).to_ne_bytes();
    request
        .get_mut(pointer_at..pointer_at + pointer.len())
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?
        .copy_from_slice(&pointer);
    // SAFETY: the one pointer the request carries is `out`'s, set just above: writable for
    // `out_len` bytes, the size the caller's request declares, and alive past the call.
    unsafe { set(fd, level, name, request) }?;
    Ok(out)
}

/// `setsockopt(fd, level, name, buf)`.
///
/// # Safety
///
/// Some options carry user-space pointers inside `buf` that the kernel writes through
/// (x_tables' `SO_SET_REPLACE`: the old entries' counters). Every such pointer must point to
/// writable memory of the size the request declares, alive until this returns.
unsafe fn set(fd: &OwnedFd, level: i32, name: i32, buf: &[u8]) -> io::Result<()> {
    let len = libc::socklen_t::try_from(buf.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `buf` is a valid, readable buffer of `len` bytes for the whole call (the kernel
    // copies it); the pointers it carries are the caller's to keep valid (this function's
    // contract); `fd` is an open socket we own.
    let rc = unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, buf.as_ptr().cast(), len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
