use crate::error::{Error, Result};
use crate::ffi::{self, check, sys};
use std::ffi::{CStr, c_char};
use std::fmt;
use std::mem::MaybeUninit;

/// A device's 16-byte UUID, from `cuDeviceGetUuid_v2`. Displayed like `nvidia-smi -L`
/// (`GPU-3298439a-810e-95f0-e3b8-da8e2434f657`).
///
/// Devices are identified by UUID across processes, never by ordinal: `CUDA_VISIBLE_DEVICES` may
/// order (or hide) devices differently in each process.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Uuid(pub [u8; 16]);

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for Uuid {
    type Err = Error;
    /// Parses `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (the `GPU-` prefix and hyphens optional).
    fn from_str(s: &str) -> Result<Self> {
        let t = s.strip_prefix("GPU-").unwrap_or(s);
        crate::identity::parse_uuid_text(t)
            .map(Uuid)
            .ok_or_else(|| Error::InvalidArgument(format!("not a device UUID: {s:?}")))
    }
}

/// The device's compute mode (`CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ComputeMode {
    /// Several contexts, from several processes, may use the device.
    Default,
    /// No context may be created.
    Prohibited,
    /// One context, from one process, at a time: IPC between two processes cannot work.
    ExclusiveProcess,
    /// A value newer than this crate.
    Other(i32),
}

/// What a device supports, as far as sharing is concerned (from `cuDeviceGetAttribute`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceCapabilities {
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`.
    pub compute_mode: ComputeMode,
    /// `CU_DEVICE_ATTRIBUTE_INTEGRATED` (Tegra/integrated GPUs have no legacy IPC).
    pub integrated: bool,
    /// `CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`.
    pub ipc_events: bool,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (cuMemCreate and friends).
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub posix_fd_handles: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` (the device may still refuse at export
    /// time without IMEX).
    pub fabric_handles: bool,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` (stream-ordered allocator).
    pub memory_pools: bool,
    /// `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES`: the `CUmemAllocationHandleType` bits a
    /// memory pool can export (see the `MEMPOOL_HANDLE_*` constants); 0 when none, or when the
    /// driver does not know the attribute.
    pub mempool_handle_types: u32,
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
    pub unified_addressing: bool,
    /// `CU_DEVICE_ATTRIBUTE_MPS_ENABLED`: an MPS server serves this device.
    pub mps_enabled: bool,
    /// Total memory in bytes (`cuDeviceTotalMem_v2`).
    pub total_memory: usize,
    /// PCI bus id, e.g. `0000:18:00.0` (`cuDeviceGetPCIBusId`).
    pub pci_bus_id: String,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a bit of
/// [`DeviceCapabilities::mempool_handle_types`] (pools can export file descriptors).
pub const MEMPOOL_HANDLE_POSIX_FD: u32 = 0x1;
/// `CU_MEM_HANDLE_TYPE_FABRIC`: a bit of [`DeviceCapabilities::mempool_handle_types`] (pools can
/// export fabric handles, across nodes with IMEX).
pub const MEMPOOL_HANDLE_FABRIC: u32 = 0x8;

/// A CUDA device visible to this process (`CUdevice`): its ordinal here and its UUID everywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: i32,
    raw: sys::CUdevice,
    uuid: Uuid,
}

/// `cuDriverGetVersion`: the driver's CUDA version as `major * 1000 + minor * 10` (13000 = 13.0).
///
/// # Errors
/// [`Error::DriverNotFound`] without a driver.
#[doc(alias = "cuDriverGetVersion")]
pub fn driver_version() -> Result<i32> {
    ffi::driver_api()?;
    let mut v = MaybeUninit::<i32>::uninit();
    // SAFETY: driver loaded (`driver_api`); `v` is a valid out-pointer for one int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(v.as_mut_ptr())
    })?;
    // SAFETY: written by the driver on success.
    Ok(unsafe { v.assume_init() })
}

impl Device {
    /// Number of devices visible to this process (`cuDeviceGetCount`).
    ///
    /// # Errors
    /// [`Error::DriverNotFound`] without a driver; [`Error::Cuda`] when `cuInit` or the count fails
    /// (`CUDA_ERROR_NO_DEVICE` when none is visible).
    #[doc(alias = "cuDeviceGetCount")]
    pub fn count() -> Result<usize> {
        ffi::driver_api()?;
        let mut n = MaybeUninit::<i32>::uninit();
        // SAFETY: driver loaded; `n` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(n.as_mut_ptr())
        })?;
        // SAFETY: written on success.
        Ok(unsafe { n.assume_init() }.max(0) as usize)
    }

    /// The device with this ordinal in this process (`cuDeviceGet`, then its UUID).
    ///
    /// # Errors
    /// [`Error::DriverNotFound`]; [`Error::Cuda`] with `CUDA_ERROR_INVALID_DEVICE` for an ordinal out
    /// of range.
    #[doc(alias = "cuDeviceGet")]
    pub fn get(ordinal: usize) -> Result<Device> {
        ffi::driver_api()?;
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| Error::InvalidArgument(format!("device ordinal {ordinal} too large")))?;
        let mut raw = MaybeUninit::<sys::CUdevice>::uninit();
        // SAFETY: driver loaded; `raw` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(raw.as_mut_ptr(), ordinal)
        })?;
        // SAFETY: written on success.
        let raw = unsafe { raw.assume_init() };
        let mut u = MaybeUninit::<sys::CUuuid>::uninit();
        // SAFETY: `raw` is a valid device from `cuDeviceGet`; `u` is a valid out-pointer.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), raw)
        })?;
        // SAFETY: written on success.
        let u = unsafe { u.assume_init() };
        Ok(Device {
            ordinal,
            raw,
            uuid: Uuid(u.bytes.map(|b| b as u8)),
        })
    }

    /// Every visible device, in ordinal order.
    ///
    /// # Errors
    /// As [`Device::count`] and [`Device::get`].
    pub fn all() -> Result<Vec<Device>> {
        (0..Self::count()?).map(Self::get).collect()
    }

    /// The visible device with this UUID, whatever its ordinal in this process.
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`] when no visible device has it; driver errors as [`Device::get`].
    pub fn by_uuid(uuid: Uuid) -> Result<Device> {
        Self::all()?
            .into_iter()
            .find(|d| d.uuid == uuid)
            .ok_or(Error::DeviceNotFound(uuid))
    }

    /// Ordinal in this process (depends on `CUDA_VISIBLE_DEVICES`).
    pub fn ordinal(&self) -> usize {
        self.ordinal as usize
    }

    /// The device's UUID, the same in every process.
    pub fn uuid(&self) -> Uuid {
        self.uuid
    }

    pub(crate) fn raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// The device's marketing name (`cuDeviceGetName`), e.g. `NVIDIA H200`.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver call fails.
    #[doc(alias = "cuDeviceGetName")]
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` holds 256 chars and we pass that length; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.raw)
        })?;
        // SAFETY: NUL-terminated within `buf` (the driver truncates to the given length).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// One raw attribute (`cuDeviceGetAttribute`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the attribute.
    #[doc(alias = "cuDeviceGetAttribute")]
    pub(crate) fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v = MaybeUninit::<i32>::uninit();
        // SAFETY: valid device; `v` a valid out-pointer; `attr` a variant of the bindings' enum.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(v.as_mut_ptr(), attr, self.raw)
        })?;
        // SAFETY: written on success.
        Ok(unsafe { v.assume_init() })
    }

    /// What this device supports for sharing; see [`DeviceCapabilities`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when an attribute query fails.
    pub fn capabilities(&self) -> Result<DeviceCapabilities> {
        use sys::CUdevice_attribute as A;
        let flag = |a| self.attribute(a).map(|v| v != 0);
        let compute_mode = match self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)? {
            0 => ComputeMode::Default,
            2 => ComputeMode::Prohibited,
            3 => ComputeMode::ExclusiveProcess,
            v => ComputeMode::Other(v),
        };
        let mut total = MaybeUninit::<usize>::uninit();
        // SAFETY: valid device; `total` a valid out-pointer.
        check("cuDeviceTotalMem_v2", unsafe {
            sys::cuDeviceTotalMem_v2(total.as_mut_ptr(), self.raw)
        })?;
        let mut bus = [0 as c_char; 64];
        // SAFETY: `bus` holds 64 chars and we pass that length; the driver NUL-terminates.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, self.raw)
        })?;
        Ok(DeviceCapabilities {
            compute_capability: (
                self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            compute_mode,
            integrated: flag(A::CU_DEVICE_ATTRIBUTE_INTEGRATED)?,
            ipc_events: flag(A::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)?,
            vmm: flag(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)?,
            posix_fd_handles: flag(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )?,
            fabric_handles: flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
                .unwrap_or(false),
            memory_pools: flag(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?,
            mempool_handle_types: self
                .attribute(A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)
                .map(|v| v as u32)
                .unwrap_or(0),
            unified_addressing: flag(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?,
            mps_enabled: flag(A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED).unwrap_or(false),
            // SAFETY: written on success.
            total_memory: unsafe { total.assume_init() },
            // SAFETY: NUL-terminated within `bus`.
            pci_bus_id: unsafe { CStr::from_ptr(bus.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_displays_like_nvidia_smi_and_parses_back() {
        let u: Uuid = "GPU-3298439a-810e-95f0-e3b8-da8e2434f657".parse().unwrap();
        assert_eq!(u.to_string(), "GPU-3298439a-810e-95f0-e3b8-da8e2434f657");
        assert!("GPU-zz".parse::<Uuid>().is_err());
    }

    #[test]
    fn device_calls_without_a_driver_report_driver_not_found() {
        // This test is meaningful on machines without the NVIDIA driver (CI); with one it checks
        // that the count succeeds or fails with a CUDA error, never a panic.
        match Device::count() {
            Err(Error::DriverNotFound { searched }) => assert!(searched.contains("libcuda")),
            Ok(_) | Err(Error::Cuda(_)) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}
