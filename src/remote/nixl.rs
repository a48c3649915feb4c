//! The NIXL side of the lane: finding `libnixl_capi.so` before `nixl-sys`' stubs would abort,
//! one agent with its UCX backend, registered regions, and WRITEs with a notification.
//!
//! Everything that calls `nixl-sys` is here; the bridges above see [`Lane`], [`Region`] and
//! [`Target`]. The stubs of `nixl-sys`' `stub-api` end the process when the library is missing, so
//! [`probe`] runs before the first NIXL call and [`Lane::new`] calls it.

use super::RemoteError;
use crate::error::{Error, Result, bytes};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap,
    OptArgs, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The NIXL C API library that `nixl-sys`' `stub-api` loads at run time.
pub const NIXL_CAPI: &str = "libnixl_capi.so";

/// What the user does when [`NIXL_CAPI`] cannot be loaded.
pub const NIXL_INSTALL: &str = "install NIXL (`pip install --no-deps nixl-cu13`) and put the \
     wheel's library folder (site-packages/.nixl_cu13.mesonpy.libs) on LD_LIBRARY_PATH";

/// Checks that the NIXL C API ([`NIXL_CAPI`]) loads in this process (`dlopen`, as `nixl-sys`'
/// stubs do) and that the stubs found it too (`nixl_capi_is_stub`). The result is kept: the
/// library is looked for once per process.
///
/// # Errors
/// [`Error::Unsupported`] naming the library, the loader's reason and the install step when it
/// cannot be loaded.
pub fn probe() -> Result<()> {
    static FOUND: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        // The handle is kept open for the life of the process (leaked below): nothing it registered
        // is unloaded. SAFETY: loading runs the library's initialisers; it is the library
        // `nixl-sys` loads itself (same name and search path), whose initialisers need nothing.
        match unsafe { libloading::Library::new(NIXL_CAPI) } {
            Ok(lib) => {
                std::mem::forget(lib);
                if nixl_sys::is_stub() {
                    Err(format!(
                        "{NIXL_CAPI} loads here, but nixl-sys' stubs did not find it"
                    ))
                } else {
                    Ok(())
                }
            }
            Err(e) => Err(format!("{NIXL_CAPI} could not be loaded ({e})")),
        }
    });
    found.clone().map_err(|reason| Error::Unsupported {
        what: "the remote lane (NVIDIA NIXL)",
        reason,
        fix: NIXL_INSTALL,
    })
}

/// Where a region's bytes live, as NIXL names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Place {
    /// Host memory (NIXL's `DRAM_SEG`).
    Host,
    /// Device memory of the CUDA device with this ordinal in the registering process (`VRAM_SEG`).
    Device(u32),
}

impl Place {
    fn mem_type(self) -> MemType {
        match self {
            Place::Host => MemType::Dram,
            Place::Device(_) => MemType::Vram,
        }
    }
    fn dev_id(self) -> u64 {
        match self {
            Place::Host => 0,
            Place::Device(d) => d as u64,
        }
    }
    /// The wire code: 0 host, 1 device.
    pub(super) fn code(self) -> (u8, u32) {
        match self {
            Place::Host => (0, 0),
            Place::Device(d) => (1, d),
        }
    }
    /// The place of wire code `kind` (0 host, 1 device) and device `dev`.
    pub(super) fn from_code(kind: u8, dev: u32) -> Option<Place> {
        match kind {
            0 => Some(Place::Host),
            1 => Some(Place::Device(dev)),
            _ => None,
        }
    }
}

/// A range of memory this process owns a mapping of, described to NIXL (address, bytes, place).
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// First byte's address (host virtual address or `CUdeviceptr`).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Host or device memory.
    pub place: Place,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.place.mem_type()
    }
    fn device_id(&self) -> u64 {
        self.place.dev_id()
    }
}

/// A WRITE posted by [`Lane::post`]; [`Lane::poll`] says when it completed.
#[derive(Debug)]
pub struct Write {
    pair: (u32, u32),
    /// A WRITE of a range ([`Lane::post_range`]): its prepared request's key.
    range: Option<RangeKey>,
    start: Instant,
    done: bool,
}

/// A prepared WRITE of a range: (local key, local offset, far address, bytes).
type RangeKey = (u32, u64, u64, u64);

impl Write {
    /// When it was posted.
    pub fn posted_at(&self) -> Instant {
        self.start
    }
}

/// A registered region of the far agent, the target of WRITEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// Its address in the far process.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Host or device memory of the far process.
    pub place: Place,
}

fn nixl(call: &'static str) -> impl Fn(NixlError) -> Error {
    move |e| {
        RemoteError::Nixl {
            call,
            reason: e.to_string(),
        }
        .into()
    }
}

/// One NIXL agent with a UCX backend, the regions it registered and the transfers it prepared.
pub struct Lane {
    // Drop order: transfer requests before the registrations, those before the agent.
    /// Prepared WRITEs by (local key, far key), with the length they were made for.
    requests: HashMap<(u32, u32), (XferRequest, usize)>,
    /// The pairs whose WRITE was posted and not yet seen complete (their requests are neither
    /// posted again nor dropped meanwhile).
    in_flight: Vec<(u32, u32)>,
    /// Pairs in flight when the prepared WRITEs were dropped: dropped when they complete.
    stale: Vec<(u32, u32)>,
    /// Prepared WRITEs of ranges ([`Lane::post_range`]), and whether each is in flight.
    ranged: HashMap<RangeKey, (XferRequest, bool)>,
    registered: HashMap<u32, (Region, RegistrationHandle)>,
    notifs: NotificationMap,
    /// The WRITEs' optional arguments (the backend, "with a notification"), made once; each
    /// WRITE sets its notification's text.
    args: OptArgs,
    _backend: Backend,
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("agent", &self.name)
            .finish_non_exhaustive()
    }
}

impl Lane {
    /// Creates agent `name` (`nixlAgent`, without progress or listener threads) and its UCX backend
    /// (`createBackend("UCX")`), after [`probe`]. UCX reads its `UCX_*` environment here
    /// (`UCX_NET_DEVICES`, `UCX_TLS`, `UCX_PROTO_INFO`, `UCX_LOG_FILE`: see
    /// [`super::environment`]). The backend's `device_list` parameter is not used: NIXL 1.5 takes
    /// its entries for RDMA devices, and a network interface named there leaves UCX no path.
    /// The plugin's own parameters are used as NIXL gives them (NIXL 1.5.1: `num_workers` 1,
    /// `ucx_error_handling_mode` `peer`, `ucx_devices` empty).
    ///
    /// # Errors
    /// [`Error::Unsupported`] from [`probe`]; [`RemoteError::Nixl`] when the agent or the backend
    /// cannot be created (no UCX plugin in NIXL's plugin folder, no usable UCX transport or
    /// device).
    pub fn new(name: &str) -> Result<Lane> {
        probe()?;
        // No progress thread: it polls UCX without pause (a core per agent). The bridges drive
        // progress themselves while they wait for a WRITE (`getXferStatus`) or a notification
        // (`getNotifs`), and pause between polls when idle.
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(name, &cfg).map_err(nixl("nixl_capi_create_configured_agent"))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl("nixl_capi_get_plugin_params(UCX)"))?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| {
            let mut reason = e.to_string();
            if let Some(hint) = tls_hint(std::env::var("UCX_TLS").ok().as_deref()) {
                reason = format!("{reason} ({hint})");
            }
            Error::from(RemoteError::Nixl {
                call: "nixl_capi_create_backend(UCX)",
                reason,
            })
        })?;
        let notifs = NotificationMap::new().map_err(nixl("nixl_capi_create_notif_map"))?;
        let mut args = OptArgs::new().map_err(nixl("nixl_capi_create_opt_args"))?;
        args.add_backend(&backend)
            .map_err(nixl("nixl_capi_opt_args_add_backend"))?;
        args.set_has_notification(true)
            .map_err(nixl("nixl_capi_opt_args_set_has_notif"))?;
        Ok(Lane {
            requests: HashMap::new(),
            in_flight: Vec::new(),
            stale: Vec::new(),
            ranged: HashMap::new(),
            registered: HashMap::new(),
            notifs,
            args,
            _backend: backend,
            agent,
            name: name.to_string(),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers region `key` (`registerMem`) unless a region with that key and the same range is
    /// registered; a different range under the key replaces it (its transfers are dropped).
    ///
    /// # Safety
    /// 1. `region` is mapped in this process and stays mapped until it is replaced or the lane is
    ///    dropped.
    /// 2. Nothing else writes it while a transfer reading it runs, nor reads it while one writing
    ///    it runs, except as the channel protocol orders it.
    pub unsafe fn register(&mut self, key: u32, region: Region) -> Result<bool> {
        if let Some((r, _)) = self.registered.get(&key)
            && r.addr == region.addr
            && r.len == region.len
            && r.place == region.place
        {
            return Ok(false);
        }
        if self.in_flight.iter().any(|(l, _)| *l == key)
            || self.ranged.iter().any(|(k, (_, f))| k.0 == key && *f)
        {
            return Err(Error::InvalidArgument(format!(
                "region {key} is read by a WRITE still in flight"
            )));
        }
        self.requests.retain(|(l, _), _| *l != key);
        self.ranged.retain(|k, _| k.0 != key);
        self.registered.remove(&key);
        let h = self
            .agent
            .register_memory(&region, None)
            .map_err(nixl("nixl_capi_register_mem"))?;
        self.registered.insert(key, (region, h));
        Ok(true)
    }

    /// This agent's metadata (`getLocalMD`): its connection information and registrations, for
    /// the far agent's [`Lane::load_remote`].
    ///
    /// # Errors
    /// [`RemoteError::Nixl`] from `nixl_capi_get_local_md`.
    pub fn local_md(&self) -> Result<Vec<u8>> {
        self.agent
            .get_local_md()
            .map_err(nixl("nixl_capi_get_local_md"))
    }

    /// Loads (or reloads, after the far side registered more) the far agent's metadata
    /// (`loadRemoteMD`) and returns its name.
    ///
    /// # Errors
    /// [`RemoteError::Nixl`] from `nixl_capi_load_remote_md` (metadata of another NIXL version,
    /// or bytes that are not metadata).
    pub fn load_remote(&mut self, md: &[u8]) -> Result<String> {
        // Prepared transfers name the far registrations as they were.
        self.drop_requests();
        self.agent
            .load_remote_md(md)
            .map_err(nixl("nixl_capi_load_remote_md"))
    }

    /// Drops the prepared WRITEs, but those in flight: they are dropped once they complete
    /// ([`Lane::poll`]), or with the lane.
    fn drop_requests(&mut self) {
        let in_flight = &self.in_flight;
        self.requests.retain(|pair, _| in_flight.contains(pair));
        self.stale.extend(self.requests.keys().copied());
        // Ranged WRITEs in flight stay until the lane drops (a lane of a tensor-set bridge loads
        // the far metadata once, before any WRITE).
        self.ranged.retain(|_, (_, in_flight)| *in_flight);
    }

    /// Drops what is known of agent `remote` (`invalidateRemoteMD`); errors are logged, as this
    /// is called when the link is gone.
    pub fn forget_remote(&mut self, remote: &str) {
        self.drop_requests();
        if let Err(e) = self.agent.invalidate_remote_md(remote) {
            tracing::debug!("invalidating {remote}'s NIXL metadata: {e}");
        }
    }

    /// Posts a WRITE (`createXferReq` once per pair, then `postXferReq`) of the first `len`
    /// bytes of local region `key` to far region `target` (key `tkey`) of agent `remote`, with
    /// notification `notif` delivered to the far agent once the data is there, and waits for it
    /// to complete (`getXferStatus`), up to `timeout`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `key` is not registered or `len` exceeds either region;
    /// [`RemoteError::Nixl`] from creating, posting or checking the transfer;
    /// [`Error::Timeout`] when it did not complete in time.
    ///
    /// The wait polls `getXferStatus` without a pause for `spin` (UCX's TCP transport moves data
    /// only while it is polled), then every 20 µs to 200 µs.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        key: u32,
        len: usize,
        (tkey, target): (u32, Target),
        remote: &str,
        notif: &[u8],
        timeout: Duration,
        spin: Duration,
    ) -> Result<()> {
        let mut w = self.post(key, len, (tkey, target), remote, notif)?;
        let mut naps = 0u32;
        while !self.poll(&mut w, timeout)? {
            pause(w.start, spin, &mut naps);
        }
        Ok(())
    }

    /// Posts a WRITE (`createXferReq` once per pair of regions, then `postXferReq`) of the first
    /// `len` bytes of local region `key` to far region `target` (key `tkey`) of agent `remote`,
    /// with notification `notif` (NIXL copies it) delivered to the far agent once the data is
    /// there, and returns without waiting: [`Lane::poll`] says when it completed. Several WRITEs
    /// may be in flight at once, each between its own pair of regions; they may complete, and
    /// their notifications reach the far agent, in any order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `key` is not registered, `len` exceeds either region, or a
    /// WRITE between the same two regions is still in flight; [`RemoteError::Nixl`] from creating
    /// or posting the transfer.
    pub fn post(
        &mut self,
        key: u32,
        len: usize,
        (tkey, target): (u32, Target),
        remote: &str,
        notif: &[u8],
    ) -> Result<Write> {
        let Some((region, _)) = self.registered.get(&key) else {
            return Err(Error::InvalidArgument(format!(
                "region {key} is not registered"
            )));
        };
        if len > region.len || len as u64 > target.len {
            return Err(Error::InvalidArgument(format!(
                "a write of {} from a region of {} to one of {}",
                bytes(len),
                bytes(region.len),
                bytes(target.len)
            )));
        }
        if self.in_flight.contains(&(key, tkey)) {
            return Err(Error::InvalidArgument(format!(
                "a WRITE from region {key} to far region {tkey} is still in flight"
            )));
        }
        let region = *region;
        // The arguments made once in `new` (no allocation per WRITE but NIXL's copy of the text).
        self.args
            .set_notification_message(notif)
            .map_err(nixl("nixl_capi_opt_args_set_notif_msg"))?;
        let args = &self.args;
        // One prepared for another length is made again (none in flight: checked above).
        if self
            .requests
            .get(&(key, tkey))
            .is_some_and(|(_, prepared)| *prepared != len)
        {
            self.requests.remove(&(key, tkey));
        }
        if !self.requests.contains_key(&(key, tkey)) {
            let mut local = XferDescList::new(region.place.mem_type())
                .map_err(nixl("nixl_capi_create_xfer_dlist"))?;
            local.add_desc(region.addr as usize, len, region.place.dev_id());
            let mut far = XferDescList::new(target.place.mem_type())
                .map_err(nixl("nixl_capi_create_xfer_dlist"))?;
            far.add_desc(target.addr as usize, len, target.place.dev_id());
            let req = self
                .agent
                .create_xfer_req(XferOp::Write, &local, &far, remote, Some(args))
                .map_err(nixl("nixl_capi_create_xfer_req(WRITE)"))?;
            self.requests.insert((key, tkey), (req, len));
        }
        let Some((req, _)) = self.requests.get(&(key, tkey)) else {
            return Err(Error::InvalidArgument("no transfer request".into()));
        };
        let start = Instant::now();
        let in_progress = self
            .agent
            .post_xfer_req(req, Some(args))
            .map_err(nixl("nixl_capi_post_xfer_req"))?;
        if in_progress {
            self.in_flight.push((key, tkey));
        }
        Ok(Write {
            pair: (key, tkey),
            range: None,
            start,
            done: !in_progress,
        })
    }

    /// Posts a WRITE (`createXferReq` once per range, then `postXferReq`) of `len` bytes from
    /// byte `offset` of local region `key` to `target` (a registered far region or a range of
    /// one: its address is where the first byte lands) of agent `remote`, with notification
    /// `notif`, and returns without waiting ([`Lane::poll`]). Several may be in flight at once,
    /// each over its own range; the same range is prepared once and posted again later.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `key` is not registered, the range leaves the local region
    /// or `target`, or a WRITE of the same range is in flight; [`RemoteError::Nixl`] from
    /// creating or posting the transfer.
    pub fn post_range(
        &mut self,
        key: u32,
        offset: u64,
        len: usize,
        target: Target,
        remote: &str,
        notif: &[u8],
    ) -> Result<Write> {
        let Some((region, _)) = self.registered.get(&key) else {
            return Err(Error::InvalidArgument(format!(
                "region {key} is not registered"
            )));
        };
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > region.len as u64) || len as u64 > target.len {
            return Err(Error::InvalidArgument(format!(
                "a write of bytes {offset}+{len} from a region of {} to one of {}",
                bytes(region.len),
                bytes(target.len)
            )));
        }
        let rk: RangeKey = (key, offset, target.addr, len as u64);
        if self.ranged.get(&rk).is_some_and(|(_, f)| *f) {
            return Err(Error::InvalidArgument(format!(
                "a WRITE of bytes {offset}+{len} of region {key} is still in flight"
            )));
        }
        let region = *region;
        self.args
            .set_notification_message(notif)
            .map_err(nixl("nixl_capi_opt_args_set_notif_msg"))?;
        if !self.ranged.contains_key(&rk) {
            let mut local = XferDescList::new(region.place.mem_type())
                .map_err(nixl("nixl_capi_create_xfer_dlist"))?;
            local.add_desc((region.addr + offset) as usize, len, region.place.dev_id());
            let mut far = XferDescList::new(target.place.mem_type())
                .map_err(nixl("nixl_capi_create_xfer_dlist"))?;
            far.add_desc(target.addr as usize, len, target.place.dev_id());
            let req = self
                .agent
                .create_xfer_req(XferOp::Write, &local, &far, remote, Some(&self.args))
                .map_err(nixl("nixl_capi_create_xfer_req(WRITE)"))?;
            self.ranged.insert(rk, (req, false));
        }
        let Some((req, flying)) = self.ranged.get_mut(&rk) else {
            return Err(Error::InvalidArgument("no transfer request".into()));
        };
        let start = Instant::now();
        let in_progress = self
            .agent
            .post_xfer_req(req, Some(&self.args))
            .map_err(nixl("nixl_capi_post_xfer_req"))?;
        *flying = in_progress;
        Ok(Write {
            pair: (key, u32::MAX),
            range: Some(rk),
            start,
            done: !in_progress,
        })
    }

    /// Whether WRITE `w` ([`Lane::post`]) completed (`getXferStatus`, which also drives UCX's
    /// progress: a TCP transfer advances only while it is polled). Once it returns `true` the
    /// source region may be reused.
    ///
    /// # Errors
    /// [`RemoteError::Nixl`] from `nixl_capi_get_xfer_status`; [`Error::Timeout`] when it has
    /// been in flight longer than `timeout` (the request stays in flight inside NIXL and is
    /// dropped with the lane; its regions take no other WRITE).
    pub fn poll(&mut self, w: &mut Write, timeout: Duration) -> Result<bool> {
        if w.done {
            return Ok(true);
        }
        if let Some(rk) = w.range {
            return self.poll_range(w, rk, timeout);
        }
        let Some((req, _)) = self.requests.get(&w.pair) else {
            return Err(Error::InvalidArgument("no transfer request".into()));
        };
        match self
            .agent
            .get_xfer_status(req)
            .map_err(nixl("nixl_capi_get_xfer_status"))?
        {
            XferStatus::Success => {
                w.done = true;
                self.in_flight.retain(|p| *p != w.pair);
                if self.stale.contains(&w.pair) {
                    self.stale.retain(|p| *p != w.pair);
                    self.requests.remove(&w.pair);
                }
                Ok(true)
            }
            XferStatus::InProgress if w.start.elapsed() > timeout => Err(Error::Timeout {
                what: "a NIXL WRITE to complete",
                after: w.start.elapsed(),
            }),
            XferStatus::InProgress => Ok(false),
        }
    }

    fn poll_range(&mut self, w: &mut Write, rk: RangeKey, timeout: Duration) -> Result<bool> {
        let Some((req, flying)) = self.ranged.get_mut(&rk) else {
            return Err(Error::InvalidArgument("no transfer request".into()));
        };
        match self
            .agent
            .get_xfer_status(req)
            .map_err(nixl("nixl_capi_get_xfer_status"))?
        {
            XferStatus::Success => {
                w.done = true;
                *flying = false;
                Ok(true)
            }
            XferStatus::InProgress if w.start.elapsed() > timeout => Err(Error::Timeout {
                what: "a NIXL WRITE to complete",
                after: w.start.elapsed(),
            }),
            XferStatus::InProgress => Ok(false),
        }
    }

    /// Takes the notifications that arrived from any agent (`getNotifs`), as (agent, text). The
    /// lane's notifications are ASCII text (see `wire::FrameNote`).
    ///
    /// # Errors
    /// [`RemoteError::Nixl`] from `nixl_capi_get_notifs` or reading the map (a notification that
    /// is not UTF-8 text).
    pub fn take_notifications(&mut self) -> Result<Vec<(String, String)>> {
        self.agent
            .get_notifications(&mut self.notifs, None)
            .map_err(nixl("nixl_capi_get_notifs"))?;
        // The common case of a poll: nothing came (no map walk, no allocation).
        if self
            .notifs
            .is_empty()
            .map_err(nixl("nixl_capi_notif_map_size"))?
        {
            return Ok(Vec::new());
        }
        let all = self
            .notifs
            .take_notifs()
            .map_err(nixl("nixl_capi_notif_map_get_notif"))?;
        Ok(all
            .into_iter()
            .flat_map(|(a, v)| v.into_iter().map(move |n| (a.clone(), n)))
            .collect())
    }
}

/// What to say of `UCX_TLS` (its value, if set) when NIXL's UCX backend could not be created:
/// NIXL refuses a list that names no CUDA transport on a machine with NVIDIA GPUs (its log says
/// so, the error it returns does not), even for a lane of host memory.
fn tls_hint(tls: Option<&str>) -> Option<String> {
    let tls = tls?;
    let names_cuda = tls
        .trim_start_matches('^')
        .split(',')
        .any(|t| t.trim().starts_with("cuda") || t.trim() == "all");
    let excludes = tls.starts_with('^');
    (!names_cuda || excludes).then(|| {
        format!(
            "UCX_TLS={tls} enables no CUDA transport: where NVIDIA GPUs are present NIXL's UCX \
             backend needs cuda_copy (or cuda) in the list, e.g. UCX_TLS={}cuda_copy",
            if excludes || tls.is_empty() {
                "tcp,self,".to_string()
            } else {
                format!("{tls},")
            }
        )
    })
}

/// One step of a poll loop that started at `start`: spins (polling UCX without a pause, which
/// also moves the data: a TCP transfer advances only while its ends poll) for `spin`, then naps
/// (20 µs, growing to 200 µs; `naps` counts them), so that an idle lane costs no core.
pub(super) fn pause(start: Instant, spin: Duration, naps: &mut u32) {
    if start.elapsed() < spin {
        std::hint::spin_loop();
    } else {
        *naps = naps.saturating_add(1);
        let us = (*naps).min(10) * 20;
        std::thread::sleep(Duration::from_micros(us as u64));
    }
}

#[cfg(test)]
mod tests {
    use super::{AgentConfig, probe, tls_hint};
    use nixl_sys::Agent;

    /// The lanes rely on UCX's peer error handling (a dead far agent fails the transfers to it):
    /// NIXL's UCX plugin asks for it by default, and `Lane::new` passes the plugin's parameters on
    /// unchanged. A NIXL whose default changed fails here.
    #[test]
    fn the_ucx_plugin_asks_for_peer_error_handling() {
        if let Err(e) = probe() {
            panic!("NIXL's libraries are needed (LD_LIBRARY_PATH, as .ci/run sets it): {e}");
        }
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured("cuda-ipc-params-test", &cfg).unwrap();
        let (_mems, params) = agent.get_plugin_params("UCX").unwrap();
        let map: std::collections::HashMap<String, String> = params.iter().unwrap().into();
        assert_eq!(
            map.get("ucx_error_handling_mode").map(String::as_str),
            Some("peer"),
            "{map:?}"
        );
    }

    #[test]
    fn a_transport_list_without_cuda_is_named_in_the_backend_error() {
        assert_eq!(tls_hint(None), None);
        assert_eq!(tls_hint(Some("tcp,cuda_copy")), None);
        assert_eq!(tls_hint(Some("all")), None);
        let h = tls_hint(Some("tcp,self")).unwrap();
        assert!(
            h.contains("UCX_TLS=tcp,self enables no CUDA transport"),
            "{h}"
        );
        assert!(h.contains("UCX_TLS=tcp,self,cuda_copy"), "{h}");
        assert!(
            tls_hint(Some("^cuda_ipc"))
                .unwrap()
                .contains("UCX_TLS=tcp,self,cuda_copy")
        );
    }
}
