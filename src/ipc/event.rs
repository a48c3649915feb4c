use super::cache::{self, lock};
use super::flight::{Lease, SingleFlight};
use super::handle::{IpcEventHandle, NotImportable, to_raw_event};
use crate::driver::{Context, Device, Event, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, Weak};

/// Exports of this process: event handle bytes → event.
static LOCAL_EVENTS: Mutex<BTreeMap<[u8; 64], Weak<SharedEvent>>> = Mutex::new(BTreeMap::new());

/// Key of an opened event: the handle's bytes (unique on this host by themselves, like a legacy
/// memory handle's) and the importing context's address (held by the event while it lives).
type EventKey = ([u8; 64], usize);

/// Events opened from other processes' handles, one per (handle, context): the single-flight
/// cache of [`super::flight`], so threads opening one handle at once share one
/// `cuIpcOpenEventHandle` and the last drop destroys it once.
static EVENTS: SingleFlight<EventKey, SharedEvent> = SingleFlight::new();

/// The event the [`IpcEvent`]s on it share.
#[derive(Debug)]
struct SharedEvent {
    // Drop order: the event is destroyed, its close counted, then the lease frees the cache key
    // (so a later open of the same handle starts after this destroy). No lease for events made
    // here.
    event: Event,
    _closed: CountOnDrop,
    _lease: Option<Lease<EventKey, SharedEvent>>,
}

/// Adds one to a statistics counter when dropped (the close counter of an opened event).
#[derive(Debug)]
struct CountOnDrop(Option<&'static AtomicU64>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            cache::bump(c);
        }
    }
}

/// An interprocess event: created here with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`, or
/// opened from another process's [`IpcEventHandle`].
///
/// Record it on a stream after the work to hand off ([`Event::record`]); the other side makes its
/// stream wait on it ([`Stream::wait_event`]) without blocking any host thread. Cloning shares the
/// same event, and so does opening one handle twice in one context. Derefs to [`Event`] for `record`, `is_complete` and `synchronize`.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html> and `cuIpcGetEventHandle`.
#[derive(Debug, Clone)]
pub struct IpcEvent {
    event: Arc<SharedEvent>,
    handle: IpcEventHandle,
    imported: bool,
}

impl IpcEvent {
    /// Creates an interprocess event in `ctx` and takes its handle (`cuEventCreate`,
    /// `cuIpcGetEventHandle`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no IPC events; [`Error::Cuda`] from either call.
    #[doc(alias = "cuIpcGetEventHandle")]
    pub fn new(ctx: &Arc<Context>) -> Result<IpcEvent> {
        crate::probe::require_ipc_events(&ctx.device())?;
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let event = Arc::new(SharedEvent {
            event: Event::with_flags(ctx, flags)?,
            _closed: CountOnDrop(None),
            _lease: None,
        });
        let _cur = ctx.enter()?;
        let mut h = MaybeUninit::<sys::CUipcEventHandle>::uninit();
        // SAFETY: context current (`_cur`); the event was created with CU_EVENT_INTERPROCESS;
        // `h` a valid out-pointer.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(h.as_mut_ptr(), event.event.as_raw())
        })?;
        // SAFETY: written on success.
        let h = unsafe { h.assume_init() };
        let handle = IpcEventHandle(h.reserved.map(|b| b as u8));
        let mut local = lock(&LOCAL_EVENTS);
        local.retain(|_, w| w.strong_count() > 0);
        local.insert(handle.0, Arc::downgrade(&event));
        Ok(IpcEvent {
            event,
            handle,
            imported: false,
        })
    }

    /// The event's handle, to send to another process.
    pub fn ipc_handle(&self) -> IpcEventHandle {
        self.handle
    }

    /// A token for this event (kind [`TokenKind::LegacyEvent`], length 0).
    ///
    /// # Errors
    /// [`Error::Os`] when this process's identity cannot be read from `/proc`.
    pub fn export(&self) -> Result<Token> {
        Ok(Token {
            kind: TokenKind::LegacyEvent,
            handle: self.handle.0,
            offset: 0,
            len: 0,
            device: self.event.event.context().device().uuid(),
            exporter: ProcessIdentity::current()?,
            export_id: 0,
        })
    }

    /// Opens an event token on the device it names, in that device's primary context.
    ///
    /// # Errors
    /// As [`IpcEvent::open_in`], and [`Error::DeviceNotFound`].
    pub fn open(token: &Token) -> Result<IpcEvent> {
        let ctx = Device::by_uuid(token.device)?.primary_context()?;
        Self::open_in(&ctx, token)
    }

    /// Opens an event token in `ctx` (`cuIpcOpenEventHandle`). A token this process exported returns
    /// its own event.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when the token's kind is not [`TokenKind::LegacyEvent`];
    /// [`Error::NotImportable`] when its exporter has this process's pid in another pid namespace
    /// (the driver would take this process for the exporter); as [`IpcEventHandle::open`].
    pub fn open_in(ctx: &Arc<Context>, token: &Token) -> Result<IpcEvent> {
        if token.kind != TokenKind::LegacyEvent {
            return Err(Error::InvalidToken(format!(
                "expected an event token, got {:?}",
                token.kind
            )));
        }
        NotImportable::own_or_openable(&token.exporter, "cuIpcOpenEventHandle")?;
        IpcEventHandle(token.handle).open(ctx)
    }

    /// Whether this event was opened from another process's handle.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Records the event on `stream` (`cuEventRecord`); alias of [`Event::record`].
    ///
    /// # Errors
    /// As [`Event::record`].
    pub fn record_on(&self, stream: &Stream) -> Result<()> {
        self.event.event.record(stream)
    }
}

impl IpcEventHandle {
    /// Opens the event this handle names in `ctx` (`cuIpcOpenEventHandle`). A handle this process
    /// exported returns its own event (the driver refuses those).
    ///
    /// Opens are cached per (handle, context): opening a handle that is already open in `ctx`
    /// shares that event (one `cuIpcOpenEventHandle`, one `cuEventDestroy_v2` when the last
    /// [`IpcEvent`] on it drops), and threads opening it at once wait for one open. When that open
    /// fails, every thread that waited gets its error; a later call tries again.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it names an event this process exported and has dropped;
    /// [`Error::Cuda`] naming `cuIpcOpenEventHandle` for a garbage or stale handle.
    #[doc(alias = "cuIpcOpenEventHandle")]
    pub fn open(&self, ctx: &Arc<Context>) -> Result<IpcEvent> {
        match lock(&LOCAL_EVENTS).get(&self.0).map(Weak::upgrade) {
            Some(Some(event)) => {
                return Ok(IpcEvent {
                    event,
                    handle: *self,
                    imported: false,
                });
            }
            Some(None) => {
                return Err(Error::InvalidArgument(
                    "the handle names an event this process exported and has since dropped".into(),
                ));
            }
            None => {}
        }
        let key = (self.0, ctx.as_raw() as usize);
        let (event, how) = EVENTS.get_or_open(key, |lease| {
            let _cur = ctx.enter()?;
            let mut raw = MaybeUninit::<sys::CUevent>::uninit();
            // SAFETY: context current (`_cur`); `raw` a valid out-pointer; the driver validates the
            // handle bytes.
            check("cuIpcOpenEventHandle", unsafe {
                sys::cuIpcOpenEventHandle(raw.as_mut_ptr(), to_raw_event(self))
            })?;
            cache::bump(&cache::EVENT_OPENS);
            // SAFETY: written on success; the opened event is owned by the new `Event` and
            // destroyed once by its Drop (`cuEventDestroy` is how an opened IPC event is released),
            // when the last `IpcEvent` on it drops.
            let event = unsafe { Event::from_raw(ctx, raw.assume_init()) };
            Ok(SharedEvent {
                event,
                _closed: CountOnDrop(Some(&cache::EVENT_CLOSES)),
                _lease: Some(lease),
            })
        })?;
        if let cache::Served::Hit { .. } = how {
            cache::bump(&cache::EVENT_HITS);
        }
        cache::count_wait(how);
        Ok(IpcEvent {
            event,
            handle: *self,
            imported: true,
        })
    }
}

impl Deref for IpcEvent {
    type Target = Event;
    fn deref(&self) -> &Event {
        &self.event.event
    }
}
