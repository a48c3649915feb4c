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

/// Why a legacy IPC handle cannot be opened in this process, found before the driver is asked.
/// Returned as [`crate::Error::NotImportable`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotImportable {
    /// The exporter's pid (as its own pid namespace counts it) equals this process's, in another
    /// pid namespace (or it is a dead exporter whose pid this process now has). The driver takes
    /// such an importer for the exporter itself and `cuIpcOpenMemHandle_v2` fails with
    /// `CUDA_ERROR_INVALID_CONTEXT` (measured on an H200 with driver 580: two processes that are
    /// both pid 1, or both pid 2, of different pid namespaces; any other pair opens). Two containers
    /// whose main processes share a handle are exactly this case.
    #[error(
        "a legacy IPC handle of process {pid} (pid namespace {exporter_pid_ns}) cannot be opened by this process, also pid {pid} (pid namespace {importer_pid_ns}): the CUDA driver takes an importer with the exporter's pid for the exporter itself ({call} would fail with CUDA_ERROR_INVALID_CONTEXT); share VMM or pool memory instead (MemoryKind::Vmm, which MemoryKind::Auto picks where the device can), or start one side under another pid"
    )]
    SamePid {
        /// The pid both processes have, each in its own pid namespace.
        pid: u32,
        /// The exporter's pid namespace inode (0 when unknown).
        exporter_pid_ns: u32,
        /// This process's pid namespace inode (0 when unknown).
        importer_pid_ns: u32,
        /// The driver call that would have failed.
        call: &'static str,
    },
}

impl NotImportable {
    /// Whether a legacy handle of `exporter` is this process's own (`Ok(true)`), or another
    /// process's that the driver can open (`Ok(false)`, answered without making this process's
    /// identity when the pids differ); [`NotImportable::SamePid`] for a different process with
    /// this process's pid number.
    ///
    /// # Errors
    /// [`crate::Error::NotImportable`]; as [`crate::identity::ProcessIdentity::current`] when the
    /// pids are equal.
    pub(crate) fn own_or_openable(
        exporter: &crate::identity::ProcessIdentity,
        call: &'static str,
    ) -> crate::Result<bool> {
        if exporter.pid != std::process::id() {
            return Ok(false);
        }
        let me = crate::identity::ProcessIdentity::current()?;
        match Self::same_pid(exporter, &me, call) {
            Some(e) => Err(e.into()),
            None => Ok(true),
        }
    }

    /// [`NotImportable::SamePid`] when a legacy handle exported by `exporter` cannot be opened
    /// by `me` (a different process with the same pid number), else `None`.
    pub(crate) fn same_pid(
        exporter: &crate::identity::ProcessIdentity,
        me: &crate::identity::ProcessIdentity,
        call: &'static str,
    ) -> Option<NotImportable> {
        (exporter.pid == me.pid && exporter != me).then_some(NotImportable::SamePid {
            pid: me.pid,
            exporter_pid_ns: exporter.pid_ns,
            importer_pid_ns: me.pid_ns,
            call,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::NotImportable;
    use crate::identity::ProcessIdentity;

    #[test]
    fn own_or_openable_tells_this_process_another_and_a_pid_twin_apart() {
        let me = ProcessIdentity::current().unwrap();
        assert!(NotImportable::own_or_openable(&me, "call").unwrap());
        let other = ProcessIdentity {
            pid: me.pid.wrapping_add(1),
            ..me
        };
        assert!(!NotImportable::own_or_openable(&other, "call").unwrap());
        let twin = ProcessIdentity {
            pid_ns: me.pid_ns.wrapping_add(1),
            start_time: me.start_time + 1,
            ..me
        };
        assert!(matches!(
            NotImportable::own_or_openable(&twin, "call"),
            Err(crate::Error::NotImportable(NotImportable::SamePid { .. }))
        ));
    }

    #[test]
    fn a_handle_of_another_namespace_s_process_with_our_pid_is_refused_by_name() {
        let me = ProcessIdentity::current().unwrap();
        let mut twin = me;
        twin.pid_ns = me.pid_ns.wrapping_add(1);
        twin.start_time = me.start_time + 1;
        let e = NotImportable::same_pid(&twin, &me, "cuIpcOpenMemHandle_v2").unwrap();
        let text = e.to_string();
        assert!(text.contains(&format!("also pid {}", me.pid)), "{text}");
        assert!(text.contains("CUDA_ERROR_INVALID_CONTEXT"), "{text}");
        assert!(text.contains("MemoryKind::Vmm"), "{text}");
    }

    #[test]
    fn our_own_handle_and_other_pids_are_left_to_the_driver() {
        let me = ProcessIdentity::current().unwrap();
        assert_eq!(
            NotImportable::same_pid(&me, &me, "x"),
            None,
            "a self-import"
        );
        let mut other = me;
        other.pid = me.pid.wrapping_add(1);
        other.pid_ns = me.pid_ns.wrapping_add(1);
        assert_eq!(NotImportable::same_pid(&other, &me, "x"), None);
    }
}
