//! Owned wrappers over libnftnl objects (`nftnl-sys`), so the rest of the netlink layer never
//! touches a raw pointer. libnftnl copies every string and buffer it is given, so Rust values
//! passed in may be dropped right after a setter returns.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_void};
use std::ptr::NonNull;

use nftnl_sys as sys;

use super::error::NetlinkError;

/// nf_tables message types (`enum nf_tables_msg_types`).
pub(super) mod msg {
    pub(crate) const NEWTABLE: u16 = 0;
    pub(crate) const GETTABLE: u16 = 1;
    pub(crate) const DELTABLE: u16 = 2;
    pub(crate) const NEWCHAIN: u16 = 3;
    pub(crate) const GETCHAIN: u16 = 4;
    pub(crate) const DELCHAIN: u16 = 5;
    pub(crate) const NEWRULE: u16 = 6;
    pub(crate) const GETRULE: u16 = 7;
    pub(crate) const DELRULE: u16 = 8;
    pub(crate) const NEWSET: u16 = 9;
    pub(crate) const GETSET: u16 = 10;
    pub(crate) const DELSET: u16 = 11;
    pub(crate) const NEWSETELEM: u16 = 12;
    pub(crate) const GETSETELEM: u16 = 13;
    pub(crate) const DELSETELEM: u16 = 14;
    /// Deletes elements, ignoring those that do not exist (Linux 6.3).
    pub(crate) const DESTROYSETELEM: u16 = 30;
    /// A trace event, multicast to `NFNLGRP_NFTRACE` (never requested).
    pub(crate) const TRACE: u16 = 17;
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
        pub(crate) struct $name(NonNull<$raw>);

        impl $name {
            pub(crate) fn new() -> Result<Self, NetlinkError> {
                // SAFETY: the allocator has no preconditions; NULL means out of memory.
                let p = unsafe { $alloc() };
                NonNull::new(p).map($name).ok_or(NetlinkError::OutOfMemory)
            }

            pub(crate) fn as_ptr(&self) -> *mut $raw {
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
owned!(Trace, sys::nftnl_trace, sys::nftnl_trace_alloc, sys::nftnl_trace_free);

impl Table {
    pub(super) fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_table_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub(super) fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_table_set_u32(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_table_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub(super) fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_table_get_str(self.as_ptr(), attr) })
    }
    pub(super) fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { (sys::nftnl_table_is_set(self.as_ptr(), attr)).then(|| sys::nftnl_table_get_u32(self.as_ptr(), attr)) }
    }
    pub(super) fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
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
    pub(super) fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_chain_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub(super) fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_chain_set_u32(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_s32(&mut self, attr: u16, value: i32) {
        // SAFETY: valid object; the attribute is an s32 attribute.
        unsafe { sys::nftnl_chain_set_s32(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_chain_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub(super) fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid object.
        unsafe { sys::nftnl_chain_is_set(self.as_ptr(), attr) }
    }
    pub(super) fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_chain_get_str(self.as_ptr(), attr) })
    }
    pub(super) fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_chain_get_u32(self.as_ptr(), attr)) }
    }
    pub(super) fn get_s32(&self, attr: u16) -> Option<i32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_chain_get_s32(self.as_ptr(), attr)) }
    }
    pub(super) fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe { copy_out(sys::nftnl_chain_get_data(self.as_ptr(), attr, &mut len), len) }
    }
    /// A string-array attribute (`NFTNL_CHAIN_DEVICES`); empty when unset.
    pub(super) fn get_str_array(&self, attr: u16) -> Vec<String> {
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
    pub(super) fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_rule_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub(super) fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_rule_set_u32(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_rule_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub(super) fn set_u64(&mut self, attr: u16, value: u64) {
        // SAFETY: valid object; the attribute is a u64 attribute.
        unsafe { sys::nftnl_rule_set_u64(self.as_ptr(), attr, value) };
    }
    pub(super) fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_rule_get_str(self.as_ptr(), attr) })
    }
    pub(super) fn get_u64(&self, attr: u16) -> Option<u64> {
        // SAFETY: valid object; the attribute is read only when set.
        unsafe { sys::nftnl_rule_is_set(self.as_ptr(), attr).then(|| sys::nftnl_rule_get_u64(self.as_ptr(), attr)) }
    }
    pub(super) fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
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
    pub(super) fn add_expr(&mut self, expr: Expr) {
        let p = expr.into_raw();
        // SAFETY: valid objects; the rule takes ownership of the expression.
        unsafe { sys::nftnl_rule_add_expr(self.as_ptr(), p) };
    }
    /// Calls `f` for each expression of the rule, in order.
    pub(super) fn for_each_expr(&self, mut f: impl FnMut(&ExprRef<'_>)) {
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
    pub(super) fn set_str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
        let c = cstring(value)?;
        // SAFETY: valid object and NUL-terminated string; libnftnl copies it.
        unsafe { sys::nftnl_set_set_str(self.as_ptr(), attr, c.as_ptr()) };
        Ok(())
    }
    pub(super) fn set_u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid object; the attribute is a u32 attribute.
        unsafe { sys::nftnl_set_set_u32(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_u64(&mut self, attr: u16, value: u64) {
        // SAFETY: valid object; the attribute is a u64 attribute.
        unsafe { sys::nftnl_set_set_u64(self.as_ptr(), attr, value) };
    }
    pub(super) fn set_data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid object; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_set_set_data(self.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub(super) fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid object.
        unsafe { sys::nftnl_set_is_set(self.as_ptr(), attr) }
    }
    pub(super) fn get_str(&self, attr: u16) -> Option<String> {
        // SAFETY: valid object; NULL when unset.
        opt_str(unsafe { sys::nftnl_set_get_str(self.as_ptr(), attr) })
    }
    pub(super) fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_set_get_u32(self.as_ptr(), attr)) }
    }
    pub(super) fn get_u64(&self, attr: u16) -> Option<u64> {
        // SAFETY: valid object.
        unsafe { self.is_set(attr).then(|| sys::nftnl_set_get_u64(self.as_ptr(), attr)) }
    }
    pub(super) fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid object; the returned buffer holds `len` bytes owned by the object.
        unsafe { copy_out(sys::nftnl_set_get_data(self.as_ptr(), attr, &mut len), len) }
    }
    /// Hands an expression (`counter`) to the set, which frees it: the kernel clones the
    /// set's expressions into each element added without its own.
    pub(super) fn add_expr(&mut self, expr: Expr) {
        let p = expr.into_raw();
        // SAFETY: valid objects; the set takes ownership of the expression.
        unsafe { sys::nftnl_set_add_expr(self.as_ptr(), p) };
    }
    /// The names of the set's expressions (`counter`), in order.
    pub(super) fn expr_names(&self) -> Vec<String> {
        unsafe extern "C" fn trampoline(e: *mut sys::nftnl_expr, data: *mut c_void) -> std::os::raw::c_int {
            // SAFETY: `data` is the `Vec<String>` passed below, alive for the whole foreach.
            let names = unsafe { &mut *data.cast::<Vec<String>>() };
            if let Some(ptr) = NonNull::new(e) {
                names.push(ExprRef { ptr, _rule: std::marker::PhantomData }.name());
            }
            0
        }
        let mut names: Vec<String> = Vec::new();
        // SAFETY: valid set; the callback only reads each expression during the call.
        unsafe {
            sys::nftnl_set_expr_foreach(self.as_ptr(), Some(trampoline), (&mut names as *mut Vec<String>).cast());
        }
        names
    }
    /// Hands an element to the set, which frees it.
    #[cfg(test)]
    pub(super) fn add_elem(&mut self, elem: SetElem) {
        let p = elem.into_raw();
        // SAFETY: valid objects; the set takes ownership of the element.
        unsafe { sys::nftnl_set_elem_add(self.as_ptr(), p) };
    }
    /// Calls `f` for each element of the set.
    pub(super) fn for_each_elem(&self, mut f: impl FnMut(&SetElemRef<'_>)) {
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
pub(super) struct Expr(NonNull<sys::nftnl_expr>);

impl Expr {
    pub(super) fn new(name: &str) -> Result<Expr, NetlinkError> {
        let c = cstring(name)?;
        // SAFETY: NUL-terminated name; NULL means unknown expression or out of memory.
        let p = unsafe { sys::nftnl_expr_alloc(c.as_ptr()) };
        NonNull::new(p).map(Expr).ok_or(NetlinkError::OutOfMemory)
    }
    pub(super) fn u32(&mut self, attr: u16, value: u32) -> &mut Self {
        // SAFETY: valid expression; the attribute is a u32 attribute.
        unsafe { sys::nftnl_expr_set_u32(self.0.as_ptr(), attr, value) };
        self
    }
    pub(super) fn u8(&mut self, attr: u16, value: u8) -> &mut Self {
        // SAFETY: valid expression; the attribute is a u8 attribute.
        unsafe { sys::nftnl_expr_set_u8(self.0.as_ptr(), attr, value) };
        self
    }
    pub(super) fn u64(&mut self, attr: u16, value: u64) -> &mut Self {
        // SAFETY: valid expression; the attribute is a u64 attribute.
        unsafe { sys::nftnl_expr_set_u64(self.0.as_ptr(), attr, value) };
        self
    }
    pub(super) fn data(&mut self, attr: u16, data: &[u8]) -> &mut Self {
        // SAFETY: valid expression; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_expr_set(self.0.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
        self
    }
    pub(super) fn str(&mut self, attr: u16, value: &str) -> Result<&mut Self, NetlinkError> {
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
pub(super) struct ExprRef<'a> {
    ptr: NonNull<sys::nftnl_expr>,
    _rule: std::marker::PhantomData<&'a Rule>,
}

impl ExprRef<'_> {
    pub(super) fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid expression borrowed from its rule.
        unsafe { sys::nftnl_expr_is_set(self.ptr.as_ptr(), attr) }
    }
    pub(super) fn name(&self) -> String {
        // SAFETY: valid expression; NFTNL_EXPR_NAME is always set.
        opt_str(unsafe { sys::nftnl_expr_get_str(self.ptr.as_ptr(), sys::NFTNL_EXPR_NAME as u16) }).unwrap_or_default()
    }
    pub(super) fn u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid expression.
        self.is_set(attr).then(|| unsafe { sys::nftnl_expr_get_u32(self.ptr.as_ptr(), attr) })
    }
    pub(super) fn u8(&self, attr: u16) -> Option<u8> {
        // SAFETY: valid expression.
        self.is_set(attr).then(|| unsafe { sys::nftnl_expr_get_u8(self.ptr.as_ptr(), attr) })
    }
    pub(super) fn u64(&self, attr: u16) -> Option<u64> {
        // SAFETY: valid expression.
        self.is_set(attr).then(|| unsafe { sys::nftnl_expr_get_u64(self.ptr.as_ptr(), attr) })
    }
    pub(super) fn str(&self, attr: u16) -> Option<String> {
        if !self.is_set(attr) {
            return None;
        }
        // SAFETY: valid expression; NUL-terminated string owned by it.
        opt_str(unsafe { sys::nftnl_expr_get_str(self.ptr.as_ptr(), attr) })
    }
    pub(super) fn data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid expression; the buffer holds `len` bytes owned by it.
        unsafe { copy_out(sys::nftnl_expr_get(self.ptr.as_ptr(), attr, &mut len), len) }
    }
}

/// A set element being built; owned until handed to a set (tests: libnftnl's encoding, which
/// the encoder's own must match).
#[cfg(test)]
pub(super) struct SetElem(NonNull<sys::nftnl_set_elem>);

#[cfg(test)]
impl SetElem {
    pub(super) fn new() -> Result<SetElem, NetlinkError> {
        // SAFETY: no preconditions; NULL means out of memory.
        let p = unsafe { sys::nftnl_set_elem_alloc() };
        NonNull::new(p).map(SetElem).ok_or(NetlinkError::OutOfMemory)
    }
    pub(super) fn data(&mut self, attr: u16, data: &[u8]) {
        // SAFETY: valid element; libnftnl copies `data.len()` bytes.
        unsafe { sys::nftnl_set_elem_set(self.0.as_ptr(), attr, data.as_ptr().cast::<c_void>(), len32(data)) };
    }
    pub(super) fn u32(&mut self, attr: u16, value: u32) {
        // SAFETY: valid element; the attribute is a u32 attribute.
        unsafe { sys::nftnl_set_elem_set_u32(self.0.as_ptr(), attr, value) };
    }
    pub(super) fn str(&mut self, attr: u16, value: &str) -> Result<(), NetlinkError> {
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

#[cfg(test)]
impl Drop for SetElem {
    fn drop(&mut self) {
        // SAFETY: still owned (not handed to a set), freed once.
        unsafe { sys::nftnl_set_elem_free(self.0.as_ptr()) }
    }
}

/// An element of a set read from the kernel.
pub(super) struct SetElemRef<'a> {
    ptr: NonNull<sys::nftnl_set_elem>,
    _set: std::marker::PhantomData<&'a Set>,
}

impl SetElemRef<'_> {
    pub(super) fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid element borrowed from its set.
        unsafe { sys::nftnl_set_elem_is_set(self.ptr.as_ptr(), attr) }
    }
    pub(super) fn data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid element; the buffer holds `len` bytes owned by it.
        unsafe { copy_out(sys::nftnl_set_elem_get(self.ptr.as_ptr(), attr, &mut len), len) }
    }
    pub(super) fn u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid element.
        self.is_set(attr).then(|| unsafe { sys::nftnl_set_elem_get_u32(self.ptr.as_ptr(), attr) })
    }
    #[cfg(test)]
    pub(super) fn str(&self, attr: u16) -> Option<String> {
        if !self.is_set(attr) {
            return None;
        }
        // SAFETY: valid element; NUL-terminated string owned by it.
        opt_str(unsafe { sys::nftnl_set_elem_get_str(self.ptr.as_ptr(), attr) })
    }
    /// The packets and bytes of the element's `counter` expression, if it has one.
    pub(super) fn counter(&self) -> Option<(u64, u64)> {
        unsafe extern "C" fn trampoline(e: *mut sys::nftnl_expr, data: *mut c_void) -> std::os::raw::c_int {
            // SAFETY: `data` is the `Option` passed below, alive for the whole foreach.
            let found = unsafe { &mut *data.cast::<Option<(u64, u64)>>() };
            if let Some(ptr) = NonNull::new(e) {
                let expr = ExprRef { ptr, _rule: std::marker::PhantomData };
                if found.is_none() && expr.name() == "counter" {
                    let attr = |a: u32| u16::try_from(a).unwrap_or(u16::MAX);
                    *found = Some((
                        expr.u64(attr(sys::NFTNL_EXPR_CTR_PACKETS)).unwrap_or(0),
                        expr.u64(attr(sys::NFTNL_EXPR_CTR_BYTES)).unwrap_or(0),
                    ));
                }
            }
            0
        }
        let mut found: Option<(u64, u64)> = None;
        // SAFETY: valid element borrowed from its set; the callback only reads each expression
        // during the call.
        unsafe {
            sys::nftnl_set_elem_expr_foreach(
                self.ptr.as_ptr(),
                Some(trampoline),
                (&mut found as *mut Option<(u64, u64)>).cast(),
            );
        }
        found
    }
}

impl Trace {
    pub(super) fn is_set(&self, attr: u16) -> bool {
        // SAFETY: valid object.
        unsafe { sys::nftnl_trace_is_set(self.as_ptr(), attr) }
    }
    pub(super) fn get_str(&self, attr: u16) -> Option<String> {
        if !self.is_set(attr) {
            return None;
        }
        // SAFETY: valid object; NUL-terminated string owned by it.
        opt_str(unsafe { sys::nftnl_trace_get_str(self.as_ptr(), attr) })
    }
    pub(super) fn get_u32(&self, attr: u16) -> Option<u32> {
        // SAFETY: valid object; the attribute is read only when set.
        self.is_set(attr).then(|| unsafe { sys::nftnl_trace_get_u32(self.as_ptr(), attr) })
    }
    pub(super) fn get_u64(&self, attr: u16) -> Option<u64> {
        // SAFETY: valid object; the attribute is read only when set.
        self.is_set(attr).then(|| unsafe { sys::nftnl_trace_get_u64(self.as_ptr(), attr) })
    }
    pub(super) fn get_data(&self, attr: u16) -> Option<Vec<u8>> {
        if !self.is_set(attr) {
            return None;
        }
        let mut len = 0u32;
        // SAFETY: valid object; the buffer holds `len` bytes owned by it.
        unsafe { copy_out(sys::nftnl_trace_get_data(self.as_ptr(), attr, &mut len), len) }
    }
}

/// What one nf_tables message carries: a libnftnl object, which libnftnl writes as the payload.
pub(super) enum Body<'a> {
    Table(&'a Table),
    Chain(&'a Chain),
    Rule(&'a Rule),
    Set(&'a Set),
    /// The elements a set object holds (`NEWSETELEM`, `DELSETELEM`, `GETSETELEM`).
    SetElements(&'a Set),
    /// Attributes already encoded, appended to the header as they are.
    Attributes(&'a [u8]),
}

/// The bytes of a netlink header.
const NLMSG_HDRLEN: usize = 16;

/// Writes one message, header and payload, into `buf`; returns its length.
///
/// # Safety
/// `buf` must be valid for writes of `nftnl::nft_nlmsg_maxsize()` bytes and 4-byte aligned.
unsafe fn write_message(buf: *mut c_void, kind: u16, family: u16, flags: u16, seq: u32, body: &Body<'_>) -> usize {
    // SAFETY: the caller guarantees room for a whole message (encoded attributes are at most
    // `MAX_ATTRIBUTES` bytes); the header is written first, then libnftnl appends the object's
    // attributes after it (or they are copied there) and the length is updated.
    unsafe {
        let nlh = sys::nftnl_nlmsg_build_hdr(buf.cast(), kind, family, flags, seq);
        match body {
            Body::Table(t) => sys::nftnl_table_nlmsg_build_payload(nlh, t.as_ptr()),
            Body::Chain(c) => sys::nftnl_chain_nlmsg_build_payload(nlh, c.as_ptr()),
            Body::Rule(r) => sys::nftnl_rule_nlmsg_build_payload(nlh, r.as_ptr()),
            Body::Set(s) => sys::nftnl_set_nlmsg_build_payload(nlh, s.as_ptr()),
            Body::SetElements(s) => sys::nftnl_set_elems_nlmsg_build_payload(nlh, s.as_ptr()),
            Body::Attributes(bytes) => {
                let at = (*nlh).nlmsg_len as usize;
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>().add(at), bytes.len());
                (*nlh).nlmsg_len += len32(bytes);
            }
        }
        (*nlh).nlmsg_len as usize
    }
}

/// One standalone request (a `GET…`, dump or not): its bytes.
pub(super) fn request(kind: u16, family: u16, flags: u16, seq: u32, body: Body<'_>) -> Vec<u8> {
    let mut buf = vec![0u32; nftnl::nft_nlmsg_maxsize() as usize / 4 + 1];
    // SAFETY: the buffer is u32-aligned and holds at least `nft_nlmsg_maxsize()` bytes.
    let len = unsafe { write_message(buf.as_mut_ptr().cast(), kind, family, flags, seq, &body) };
    buf.iter().flat_map(|w| w.to_ne_bytes()).take(len).collect()
}

/// Calls `each` with every message in `bytes` (whole netlink messages back to back, as a batch
/// page holds them): its type and the message, copied first to a u32-aligned buffer so libnftnl
/// may parse it. How tests read an encoded batch back the way a dump's answer is read; panics on
/// bytes that are not whole messages.
#[cfg(test)]
pub(super) fn each_message(bytes: &[u8], mut each: impl FnMut(u16, Received<'_>)) {
    let mut words = vec![0u32; bytes.len().div_ceil(4)];
    for (word, chunk) in words.iter_mut().zip(bytes.chunks(4)) {
        let mut b = [0u8; 4];
        b[..chunk.len()].copy_from_slice(chunk);
        *word = u32::from_ne_bytes(b);
    }
    // SAFETY: `words` holds at least `bytes.len()` initialized bytes and outlives the slice.
    let aligned = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), bytes.len()) };
    let mut off = 0usize;
    while off + NLMSG_HDRLEN <= aligned.len() {
        let len = u32::from_ne_bytes([aligned[off], aligned[off + 1], aligned[off + 2], aligned[off + 3]]) as usize;
        let kind = u16::from_ne_bytes([aligned[off + 4], aligned[off + 5]]);
        assert!(len >= NLMSG_HDRLEN && off + len <= aligned.len(), "a truncated message at byte {off}");
        each(kind, Received::new(&aligned[off..off + len]).expect("a whole, aligned message"));
        off += len.div_ceil(4) * 4;
    }
    assert_eq!(off, aligned.len(), "bytes after the last message");
}

/// One message of a batch: an owned object, written when the batch is finalized.
pub(super) struct BatchMessage {
    kind: u16,
    family: u16,
    flags: u16,
    body: OwnedBody,
    /// The sequence number the batch gave the message.
    seq: Cell<u32>,
}

enum OwnedBody {
    Table(Table),
    Chain(Chain),
    Rule(Rule),
    Set(Set),
    Attributes(Vec<u8>),
}

/// An object to own in a [`BatchMessage`].
pub(super) enum Object {
    Table(Table),
    Chain(Chain),
    Rule(Rule),
    Set(Set),
    /// Attributes encoded without libnftnl (set elements: one object per element would be a
    /// few allocations each, for hundreds of thousands of elements), at most
    /// [`MAX_ATTRIBUTES`] bytes.
    Attributes(Vec<u8>),
}

/// The most attribute bytes an [`Object::Attributes`] may hold: well below the room the batch
/// gives a message (`nft_nlmsg_maxsize()`, ~68 KiB).
pub(super) const MAX_ATTRIBUTES: usize = 48 * 1024;

impl BatchMessage {
    /// A message of type `kind` carrying `object`.
    pub(super) fn new(kind: u16, family: u16, flags: u16, object: Object) -> BatchMessage {
        let body = match object {
            Object::Table(t) => OwnedBody::Table(t),
            Object::Chain(c) => OwnedBody::Chain(c),
            Object::Rule(r) => OwnedBody::Rule(r),
            Object::Set(s) => OwnedBody::Set(s),
            Object::Attributes(mut bytes) => {
                // A message the batch has no room for would be written past its buffer.
                bytes.truncate(MAX_ATTRIBUTES);
                OwnedBody::Attributes(bytes)
            }
        };
        BatchMessage { kind, family, flags, body, seq: Cell::new(0) }
    }

    /// The sequence number the batch gave it (once added).
    pub(super) fn seq(&self) -> u32 {
        self.seq.get()
    }
}

// SAFETY: `write` builds exactly one message whose size is bounded: element messages are cut to
// a budget well below `nft_nlmsg_maxsize()` by the encoder, and other objects are far below it.
unsafe impl nftnl::NlMsg for BatchMessage {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, _: nftnl::MsgType) {
        self.seq.set(seq);
        let body = match &self.body {
            OwnedBody::Table(t) => Body::Table(t),
            OwnedBody::Chain(c) => Body::Chain(c),
            OwnedBody::Rule(r) => Body::Rule(r),
            OwnedBody::Set(s) => Body::Set(s),
            OwnedBody::Attributes(bytes) => Body::Attributes(bytes),
        };
        // SAFETY: the batch hands us a 4-byte aligned buffer of `nft_nlmsg_maxsize()` bytes.
        unsafe {
            write_message(buf, self.kind, self.family, self.flags, seq, &body);
        }
    }
}

/// One whole netlink message as received: 4-byte aligned, at least a header long, its length
/// field exactly its size. Only [`Received::new`] makes one, so libnftnl may parse it.
pub(super) struct Received<'a>(&'a [u8]);

impl<'a> Received<'a> {
    /// The message in `bytes`, if they can be one.
    pub(super) fn new(bytes: &'a [u8]) -> Option<Received<'a>> {
        if bytes.len() < NLMSG_HDRLEN || !(bytes.as_ptr() as usize).is_multiple_of(4) {
            return None;
        }
        let len = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        (len == bytes.len()).then_some(Received(bytes))
    }

    fn header(&self) -> *const libc::nlmsghdr {
        self.0.as_ptr().cast()
    }

    /// The table the message describes.
    pub(super) fn table(&self) -> Option<Table> {
        let t = Table::new().ok()?;
        // SAFETY: a whole, aligned message (see `Received::new`), alive for the call.
        (unsafe { sys::nftnl_table_nlmsg_parse(self.header(), t.as_ptr()) } >= 0).then_some(t)
    }

    /// The chain the message describes.
    pub(super) fn chain(&self) -> Option<Chain> {
        let c = Chain::new().ok()?;
        // SAFETY: as for `table`.
        (unsafe { sys::nftnl_chain_nlmsg_parse(self.header(), c.as_ptr()) } >= 0).then_some(c)
    }

    /// The rule the message describes.
    pub(super) fn rule(&self) -> Option<Rule> {
        let r = Rule::new().ok()?;
        // SAFETY: as for `table`.
        (unsafe { sys::nftnl_rule_nlmsg_parse(self.header(), r.as_ptr()) } >= 0).then_some(r)
    }

    /// The set the message describes.
    pub(super) fn set(&self) -> Option<Set> {
        let s = Set::new().ok()?;
        // SAFETY: as for `table`.
        (unsafe { sys::nftnl_set_nlmsg_parse(self.header(), s.as_ptr()) } >= 0).then_some(s)
    }

    /// The set elements the message carries, in a set object holding them.
    pub(super) fn set_elements(&self) -> Option<Set> {
        let s = Set::new().ok()?;
        // SAFETY: as for `table`.
        (unsafe { sys::nftnl_set_elems_nlmsg_parse(self.header(), s.as_ptr()) } >= 0).then_some(s)
    }

    /// The trace event the message carries (`NFT_MSG_TRACE`).
    pub(super) fn trace(&self) -> Option<Trace> {
        let t = Trace::new().ok()?;
        // SAFETY: as for `table`.
        (unsafe { sys::nftnl_trace_nlmsg_parse(self.header(), t.as_ptr()) } >= 0).then_some(t)
    }

    /// The message's bytes, header included.
    pub(super) fn bytes(&self) -> &'a [u8] {
        self.0
    }
}
