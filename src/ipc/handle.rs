use std::fmt;

/// The 64 bytes of a `CUipcMemHandle`: names one `cuMemAlloc` allocation for other processes.
///
/// Made by [`crate::driver::DeviceBuffer::ipc_handle`] (`cuIpcGetMemHandle`); opened by
/// [`IpcMemHandle::open`] (`cuIpcOpenMemHandle_v2`). The bytes are opaque; a garbage handle gives an
/// error when opened, never undefined behaviour.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "CUipcMemHandle")]
pub struct IpcMemHandle(pub [u8; 64]);

/// The 64 bytes of a `CUipcEventHandle`: names one interprocess event for other processes.
///
/// Made by [`crate::ipc::IpcEvent::ipc_handle`] (`cuIpcGetEventHandle`); opened by
/// [`IpcEventHandle::open`] (`cuIpcOpenEventHandle`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "CUipcEventHandle")]
pub struct IpcEventHandle(pub [u8; 64]);

fn short_hex(b: &[u8; 64], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for x in &b[..16] {
        write!(f, "{x:02x}")?;
    }
    write!(f, "…")
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle(")?;
        short_hex(&self.0, f)?;
        write!(f, ")")
    }
}

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcEventHandle(")?;
        short_hex(&self.0, f)?;
        write!(f, ")")
    }
}

pub(crate) fn to_raw_mem(h: &IpcMemHandle) -> crate::ffi::sys::CUipcMemHandle {
    crate::ffi::sys::CUipcMemHandle {
        reserved: h.0.map(|b| b as std::ffi::c_char),
    }
}

pub(crate) fn to_raw_event(h: &IpcEventHandle) -> crate::ffi::sys::CUipcEventHandle {
    crate::ffi::sys::CUipcEventHandle {
        reserved: h.0.map(|b| b as std::ffi::c_char),
    }
}
