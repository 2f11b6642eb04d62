//! Owned wrappers over libnftnl objects (`nftnl-sys`), so the rest of the netlink layer never
//! touches a raw pointer. libnftnl copies every string and buffer it is given, so Rust values
//! passed in may be dropped right after a setter returns.

use std::ffi::{CStr, CString, c_void};
use std::ptr::NonNull;

use nftnl_sys as sys;

use super::NetlinkError;

/// nf_tables message types (`enum nf_tables_msg_types`).
pub mod msg {
    pub const NEWTABLE: u16 = 0;
    pub const GETTABLE: u16 = 1;
    pub const DELTABLE: u16 = 2;
    pub const NEWCHAIN: u16 = 3;
    pub const GETCHAIN: u16 = 4;
    pub const DELCHAIN: u16 = 5;
    pub const NEWRULE: u16 = 6;
    pub const GETRULE: u16 = 7;
    pub const DELRULE: u16 = 8;
    pub const NEWSET: u16 = 9;
    pub const GETSET: u16 = 10;
    pub const DELSET: u16 = 11;
    pub const NEWSETELEM: u16 = 12;
    pub const GETSETELEM: u16 = 13;
    pub const DELSETELEM: u16 = 14;
}

pub(super) fn cstring(s: &str) -> Result<CString, NetlinkError> {
    CString::new(s).map_err(|_| NetlinkError::InvalidName(s.to_string()))
}

/// Reads a C string libnftnl returned, if any.
fn opt_str(p: *const std::os::raw::c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: libnftnl returns NUL-terminated strings owned by the object, valid while it lives.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

macro_rules! owned {
    ($name:ident, $raw:ty, $alloc:path, $free:path) => {
        /// An owned libnftnl object.
        pub struct $name(NonNull<$raw>);

        impl $name {
            pub fn new() -> Result<Self, NetlinkError> {
                // SAFETY: the allocator has no preconditions; NULL means out of memory.
                let p = unsafe { $alloc() };
                NonNull::new(p).map($name).ok_or(NetlinkError::OutOfMemory)
            }

            pub fn as_ptr(&self) -> *mut $raw {
                self.0.as_ptr()
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: we own the object and free it exactly once.
                unsafe { $free(self.0.as_ptr()) }
            }
        }
    };
}

owned!(Table, sys::nftnl_table, sys::nftnl_table_alloc, sys::nftnl_table_free);
owned!(Chain, sys::nftnl_chain, sys::nftnl_chain_alloc, sys::nftnl_chain_free);
owned!(Rule, sys::nftnl_rule, sys::nftnl_rule_alloc, sys::nftnl_rule_free);
owned!(Set, sys::nftnl_set, sys::nftnl_set_alloc, sys::nftnl_set_free);

impl Table {
    pub fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_table_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_table_set_u32(self.as_ptr(), attr, value) };
    }
    pub fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_table_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_table_get_str(self.as_ptr(), attr) })
    }
    pub fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { (sys::nftnl_table_is_set(self.as_ptr(), attr)).then(|| sys::nftnl_table_get_u32(self.as_ptr(), attr)) }
    }
    pub fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe {
            if !sys::nftnl_table_is_set(self.as_ptr(), attr) {
                return None;
            }
            let p = sys::nftnl_table_get_data(self.as_ptr(), attr, &mut len);
            copy_out(p, len)
        }
    }
}

impl Chain {
    pub fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_chain_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_chain_set_u32(self.as_ptr(), attr, value) };
    }
    pub fn set_s32(&mut self, attr: u16, value: i32) {
        // SAFETY: valid object; the attribute is an s32 attribute.
        unsafe { sys::nftnl_chain_set_s32(self.as_ptr(), attr, value) };
    }
    pub fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_chain_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid object.
        unsafe { sys::nftnl_chain_is_set(self.as_ptr(), attr) }
    }
    pub fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_chain_get_str(self.as_ptr(), attr) })
    }
    pub fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_chain_get_u32(self.as_ptr(), attr)) }
    }
    pub fn get_s32(&self, attr: u16) -> Option<i32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_chain_get_s32(self.as_ptr(), attr)) }
    }
    pub fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe { copy_out(sys::nftnl_chain_get_data(self.as_ptr(), attr, &mut len), len) }
    }
    /// A string-array attribute (`NFTNL_CHAIN_DEVICES`); empty when unset.
    pub fn get_str_array(&self, attr: u16) -> Vec<String> {
        let mut out = Vec::new();
        if !self.is_set(attr) {
            return out;
        }
        // SAFETY: valid object; NULL or a NULL-terminated array of C strings owned by the chain.
        let mut p = unsafe { sys::nftnl_chain_get_array(self.as_ptr(), attr) };
        while !p.is_null() {
            // SAFETY: `p` points at an entry of the array, at or before its terminating NULL.
            let s = unsafe { *p };
            if s.is_null() {
                break;
            }
            out.extend(opt_str(s));
            // SAFETY: `s` was not the terminator, so the next entry is still inside the array.
            p = unsafe { p.add(1) };
        }
        out
    }
}

impl Rule {
    pub fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_rule_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_rule_set_u32(self.as_ptr(), attr, value) };
    }
    pub fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_rule_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_rule_get_str(self.as_ptr(), attr) })
    }
    pub fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe {
            if !sys::nftnl_rule_is_set(self.as_ptr(), attr) {
                return None;
            }
            copy_out(sys::nftnl_rule_get_data(self.as_ptr(), attr, &mut len), len)
        }
    }
    /// Hands an expression to the rule, which frees it.
    pub fn add_expr(&mut self, expr: Expr) {
        let p = expr.into_raw();
        // SAFETY: valid objects; the rule takes ownership of the expression.
        unsafe { sys::nftnl_rule_add_expr(self.as_ptr(), p) };
    }
    /// Calls `f` for each expression of the rule, in order.
    pub fn for_each_expr(&self, mut f: impl FnMut(&ExprRef<'_>)) {
        unsafe extern "C" fn trampoline(e: *mut sys::nftnl_expr, data: *mut c_void) -> std::os::raw::c_int {
            // SAFETY: `data` is the `&mut dyn FnMut` passed below, alive for the whole foreach.
            let f = unsafe { &mut *data.cast::<&mut dyn FnMut(&ExprRef<'_>)>() };
            if let Some(ptr) = NonNull::new(e) {
                f(&ExprRef { ptr, _rule: std::marker::PhantomData });
            }
            0
        }
        let mut dyn_f: &mut dyn FnMut(&ExprRef<'_>) = &mut f;
        // SAFETY: valid rule; the callback only borrows expressions for the duration of the call.
        unsafe {
            sys::nftnl_expr_foreach(
                self.as_ptr(),
                Some(trampoline),
                (&mut dyn_f as *mut &mut dyn FnMut(&ExprRef<'_>)).cast(),
            );
        }
    }
}

impl Set {
    pub fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_set_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_set_set_u32(self.as_ptr(), attr, value) };
    }
    pub fn set_u64(&mut self, attr: u16, value: u64) {
        // SAFETY: valid object; the attribute is a u64 attribute.
        unsafe { sys::nftnl_set_set_u64(self.as_ptr(), attr, value) };
    }
    pub fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_set_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid object.
        unsafe { sys::nftnl_set_is_set(self.as_ptr(), attr) }
    }
    pub fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_set_get_str(self.as_ptr(), attr) })
    }
    pub fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_set_get_u32(self.as_ptr(), attr)) }
    }
    pub fn get_u64(&self, attr: u16) -> Option<u64> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_set_get_u64(self.as_ptr(), attr)) }
    }
    pub fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe { copy_out(sys::nftnl_set_get_data(self.as_ptr(), attr, &mut len), len) }
    }
    /// Hands an element to the set, which frees it.
    pub fn add_elem(&mut self, elem: SetElem) {
        let p = elem.into_raw();
        // SAFETY: valid objects; the set takes ownership of the element.
        unsafe { sys::nftnl_set_elem_add(self.as_ptr(), p) };
    }
    /// Calls `f` for each element of the set.
    pub fn for_each_elem(&self, mut f: impl FnMut(&SetElemRef<'_>)) {
        unsafe extern "C" fn trampoline(e: *mut sys::nftnl_set_elem, data: *mut c_void) -> std::os::raw::c_int {
            // SAFETY: `data` is the `&mut dyn FnMut` passed below, alive for the whole foreach.
            let f = unsafe { &mut *data.cast::<&mut dyn FnMut(&SetElemRef<'_>)>() };
            if let Some(ptr) = NonNull::new(e) {
                f(&SetElemRef { ptr, _set: std::marker::PhantomData });
            }
            0
        }
        let mut dyn_f: &mut dyn FnMut(&SetElemRef<'_>) = &mut f;
        // SAFETY: valid set; the callback only borrows elements for the duration of the call.
        unsafe {
            sys::nftnl_set_elem_foreach(
                self.as_ptr(),
                Some(trampoline),
                (&mut dyn_f as *mut &mut dyn FnMut(&SetElemRef<'_>)).cast(),
            );
        }
    }
}

fn len32(data: &[u8]) -> u32 {
    u32::try_from(data.len()).unwrap_or(u32::MAX)
}

/// Copies `len` bytes libnftnl returned.
///
/// # Safety
/// `p` must be NULL or point to at least `len` readable bytes.
unsafe fn copy_out(p: *const c_void, len: u32) -> Option<Vec<u8>> {
    if p.is_null() {
        return None;
    }
    // SAFETY: guaranteed by the caller.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len as usize) }.to_vec())
}

/// An expression being built; owned until handed to a rule.
pub struct Expr(NonNull<sys::nftnl_expr>);

impl Expr {
    pub fn new(name: &str) -> Result<Expr, NetlinkError> {
        let c = cstring(name)?;
        // SAFETY: NUL-terminated name; NULL means unknown expression or out of memory.
        let p = unsafe { sys::nftnl_expr_alloc(c.as_ptr()) };
        NonNull::new(p).map(Expr).ok_or(NetlinkError::OutOfMemory)
    }
    pub fn u32(&mut self, attr: u16, value: u32) -> &mut Self {
        // SAFETY: valid expression; the attribute is a u32 attribute.
        unsafe { sys::nftnl_expr_set_u32(self.0.as_ptr(), attr, value) };
        self
    }
    pub fn u8(&mut self, attr: u16, value: u8) -> &mut Self {
        // SAFETY: valid expression; the attribute is a u8 attribute.
        unsafe { sys::nftnl_expr_set_u8(self.0.as_ptr(), attr, value) };
        self
    }
    pub fn data(&mut self, attr: u16, data: &[u8]) -> &mut Self {
        // SAFETY: valid expression; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_expr_set(self.0.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
        self
    }
    pub fn str(&mut self, attr: u16, value: &str) -> Result<&mut Self, NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid expression and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_expr_set_str(self.0.as_ptr(), attr, c.as_ptr()) };
        Ok(self)
    }
    fn into_raw(self) -> *mut sys::nftnl_expr {
        let p = self.0.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for Expr {
    fn drop(&mut self) {
        // SAFETY: still owned (not handed to a rule), freed once.
        unsafe { sys::nftnl_expr_free(self.0.as_ptr()) }
    }
}

/// An expression inside a rule read from the kernel.
pub struct ExprRef<'a> {
    ptr: NonNull<sys::nftnl_expr>,
    _rule: std::marker::PhantomData<&'a Rule>,
}

impl ExprRef<'_> {
    pub fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid expression borrowed from its rule.
        unsafe { sys::nftnl_expr_is_set(self.ptr.as_ptr(), attr) }
    }
    pub fn name(&self) -> String {
        // SAFETY: valid expression; NFTNL_EXPR_NAME is always set.
        opt_str(unsafe { sys::nftnl_expr_get_str(self.ptr.as_ptr(), sys::NFTNL_EXPR_NAME as u16) }).unwrap_or_default()
    }
    pub fn u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid expression.
        self.is_set(attr).then(|| unsafe { sys::nftnl_expr_get_u32(self.ptr.as_ptr(), attr) })
    }
    pub fn u8(&self, attr: u16) -> Option<u8> {
        // SAFETY: valid expression.
        self.is_set(attr).then(|| unsafe { sys::nftnl_expr_get_u8(self.ptr.as_ptr(), attr) })
    }
    pub fn str(&self, attr: u16) -> Option<String> {
        if !self.is_set(attr) {
            return None;
        }
        // SAFETY: valid expression; NUL-terminated string owned by it.
        opt_str(unsafe { sys::nftnl_expr_get_str(self.ptr.as_ptr(), attr) })
    }
    pub fn data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid expression; the buffer holds `len` bytes owned by it.
        unsafe { copy_out(sys::nftnl_expr_get(self.ptr.as_ptr(), attr, &mut len), len) }
    }
}

/// A set element being built; owned until handed to a set.
pub struct SetElem(NonNull<sys::nftnl_set_elem>);

impl SetElem {
    pub fn new() -> Result<SetElem, NetlinkError> {
        // SAFETY: no preconditions; NULL means out of memory.
        let p = unsafe { sys::nftnl_set_elem_alloc() };
        NonNull::new(p).map(SetElem).ok_or(NetlinkError::OutOfMemory)
    }
    pub fn data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid element; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_set_elem_set(self.0.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub fn u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid element; the attribute is a u32 attribute.
        unsafe { sys::nftnl_set_elem_set_u32(self.0.as_ptr(), attr, value) };
    }
    pub fn str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid element and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_set_elem_set_str(self.0.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    fn into_raw(self) -> *mut sys::nftnl_set_elem {
        let p = self.0.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for SetElem {
    fn drop(&mut self) {
        // SAFETY: still owned (not handed to a set), freed once.
        unsafe { sys::nftnl_set_elem_free(self.0.as_ptr()) }
    }
}

/// An element of a set read from the kernel.
pub struct SetElemRef<'a> {
    ptr: NonNull<sys::nftnl_set_elem>,
    _set: std::marker::PhantomData<&'a Set>,
}

impl SetElemRef<'_> {
    pub fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid element borrowed from its set.
        unsafe { sys::nftnl_set_elem_is_set(self.ptr.as_ptr(), attr) }
    }
    pub fn data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid element; the buffer holds `len` bytes owned by it.
        unsafe { copy_out(sys::nftnl_set_elem_get(self.ptr.as_ptr(), attr, &mut len), len) }
    }
    pub fn u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid element.
        self.is_set(attr).then(|| unsafe { sys::nftnl_set_elem_get_u32(self.ptr.as_ptr(), attr) })
    }
    pub fn str(&self, attr: u16) -> Option<String> {
        if !self.is_set(attr) {
            return None;
        }
        // SAFETY: valid element; NUL-terminated string owned by it.
        opt_str(unsafe { sys::nftnl_set_elem_get_str(self.ptr.as_ptr(), attr) })
    }
}

/// Writes a netlink header for an nf_tables message into `buf` and returns it.
///
/// # Safety
/// `buf` must have room for a whole message (`nftnl::nft_nlmsg_maxsize()` bytes).
pub unsafe fn build_header(buf: *mut c_void, msg_type: u16, family: u16, flags: u16, seq: u32) -> *mut libc::nlmsghdr {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_nlmsg_build_hdr(buf.cast(), msg_type, family, flags, seq) }
}

/// Parses an nf_tables message into a libnftnl object.
pub fn parse_table(nlh: *const libc::nlmsghdr, t: &mut Table) -> bool {
    // SAFETY: nlh points to a complete message in a receive buffer that outlives this call.
    unsafe { sys::nftnl_table_nlmsg_parse(nlh, t.as_ptr()) >= 0 }
}
/// Parses a chain message.
pub fn parse_chain(nlh: *const libc::nlmsghdr, c: &mut Chain) -> bool {
    // SAFETY: as for `parse_table`.
    unsafe { sys::nftnl_chain_nlmsg_parse(nlh, c.as_ptr()) >= 0 }
}
/// Parses a rule message.
pub fn parse_rule(nlh: *const libc::nlmsghdr, r: &mut Rule) -> bool {
    // SAFETY: as for `parse_table`.
    unsafe { sys::nftnl_rule_nlmsg_parse(nlh, r.as_ptr()) >= 0 }
}
/// Parses a set message.
pub fn parse_set(nlh: *const libc::nlmsghdr, s: &mut Set) -> bool {
    // SAFETY: as for `parse_table`.
    unsafe { sys::nftnl_set_nlmsg_parse(nlh, s.as_ptr()) >= 0 }
}
/// Parses a set-element message into the set's element list.
pub fn parse_set_elems(nlh: *const libc::nlmsghdr, s: &mut Set) -> bool {
    // SAFETY: as for `parse_table`.
    unsafe { sys::nftnl_set_elems_nlmsg_parse(nlh, s.as_ptr()) >= 0 }
}

/// Writes a table message payload.
///
/// # Safety
/// `nlh` must be a header written by [`build_header`] in a buffer with room for the payload.
pub unsafe fn table_payload(nlh: *mut libc::nlmsghdr, t: &Table) {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_table_nlmsg_build_payload(nlh, t.as_ptr()) }
}
/// Writes a chain message payload.
///
/// # Safety
/// As for [`table_payload`].
pub unsafe fn chain_payload(nlh: *mut libc::nlmsghdr, c: &Chain) {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_chain_nlmsg_build_payload(nlh, c.as_ptr()) }
}
/// Writes a rule message payload.
///
/// # Safety
/// As for [`table_payload`].
pub unsafe fn rule_payload(nlh: *mut libc::nlmsghdr, r: &Rule) {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_rule_nlmsg_build_payload(nlh, r.as_ptr()) }
}
/// Writes a set message payload.
///
/// # Safety
/// As for [`table_payload`].
pub unsafe fn set_payload(nlh: *mut libc::nlmsghdr, s: &Set) {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_set_nlmsg_build_payload(nlh, s.as_ptr()) }
}
/// Writes a set-element message payload (all elements held by `s`).
///
/// # Safety
/// As for [`table_payload`].
pub unsafe fn set_elems_payload(nlh: *mut libc::nlmsghdr, s: &Set) {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::nftnl_set_elems_nlmsg_build_payload(nlh, s.as_ptr()) }
}
