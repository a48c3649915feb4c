//! Records: publish, get, wait, list and remove, the encoding of a record in a slot's payload
//! words, and the slot and table locks they take (taken over from a dead holder).

use super::layout::*;
use super::slot::{self, Taken, TestPoint as Point};
use super::{Record, Registry, RegistryError, SlowPath, corrupt, deadline_after};
use crate::error::{Error, Result};
use crate::identity::ProcessIdentity;
use crate::shm::futex;
use crate::sync::{Ordering, fence};
use std::time::{Duration, Instant};

/// Seqlock read attempts per slot before the reader checks on the writer.
pub(super) const READ_RETRIES: u32 = 256;

/// Checks a record name: 1 to 64 bytes of UTF-8 without control characters.
fn validate_record_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(RegistryError::InvalidName {
            name: String::new(),
            reason: "empty record name",
        }
        .into());
    }
    if name.len() > RECORD_NAME_MAX {
        return Err(RegistryError::TooLarge {
            what: "record name",
            len: name.len(),
            max: RECORD_NAME_MAX,
        }
        .into());
    }
    if name.chars().any(char::is_control) {
        return Err(RegistryError::InvalidName {
            name: name.to_string(),
            reason: "control characters are not allowed in a record name",
        }
        .into());
    }
    Ok(())
}

fn pack_bytes(words: &mut [u64], bytes: &[u8]) {
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
}

fn unpack_bytes(words: &[u64], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(words.len() * 8);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Decodes a consistent payload copy: `Ok(None)` for a free slot, an error text for bad bytes.
pub(super) fn decode(
    words: &[u64; PAYLOAD_WORDS],
    slot: u32,
) -> std::result::Result<Option<Record>, String> {
    let state = words[W_STATE] as u32;
    match state {
        STATE_FREE => return Ok(None),
        STATE_PUBLISHED => {}
        s => return Err(format!("slot {slot}: unknown state {s}")),
    }
    let kl = words[W_KIND_LENS];
    let kind = kl as u32;
    let name_len = ((kl >> 32) & 0xffff) as usize;
    let token_len = (kl >> 48) as usize;
    let meta_len = (words[W_META_LEN] & 0xffff) as usize;
    if name_len == 0 || name_len > RECORD_NAME_MAX {
        return Err(format!(
            "slot {slot}: record name length {name_len} (1 to {RECORD_NAME_MAX})"
        ));
    }
    if token_len > TOKEN_MAX {
        return Err(format!(
            "slot {slot}: token length {token_len} (at most {TOKEN_MAX})"
        ));
    }
    if meta_len > METADATA_MAX {
        return Err(format!(
            "slot {slot}: metadata length {meta_len} (at most {METADATA_MAX})"
        ));
    }
    let name = String::from_utf8(unpack_bytes(&words[W_NAME..W_TOKEN], name_len))
        .map_err(|_| format!("slot {slot}: record name is not UTF-8"))?;
    let mut owner = [0u64; 4];
    owner.copy_from_slice(&words[W_OWNER..W_NAME]);
    let owner_uid = u32::try_from(words[W_OWNER_UID])
        .map_err(|_| format!("slot {slot}: owner uid word {:#x}", words[W_OWNER_UID]))?;
    Ok(Some(Record {
        name,
        kind,
        token: unpack_bytes(&words[W_TOKEN..W_META], token_len),
        metadata: unpack_bytes(&words[W_META..W_RESERVED], meta_len),
        owner: ProcessIdentity::from_words(owner),
        owner_uid,
        seq: words[W_SEQ],
        slot,
    }))
}

fn encode(
    name: &str,
    kind: u32,
    token: &[u8],
    metadata: &[u8],
    owner: &ProcessIdentity,
    owner_uid: u32,
    seq: u64,
) -> [u64; PAYLOAD_WORDS] {
    let mut w = [0u64; PAYLOAD_WORDS];
    w[W_STATE] = u64::from(STATE_PUBLISHED);
    w[W_SEQ] = seq;
    w[W_KIND_LENS] = u64::from(kind) | ((name.len() as u64) << 32) | ((token.len() as u64) << 48);
    w[W_META_LEN] = metadata.len() as u64;
    w[W_OWNER..W_NAME].copy_from_slice(&owner.to_words());
    w[W_OWNER_UID] = u64::from(owner_uid);
    pack_bytes(&mut w[W_NAME..W_TOKEN], name.as_bytes());
    pack_bytes(&mut w[W_TOKEN..W_META], token);
    pack_bytes(&mut w[W_META..W_RESERVED], metadata);
    w
}

/// Small pause in lock loops: spin first, then yield, then sleep briefly.
fn pause(i: u32) {
    if i < 16 {
        std::hint::spin_loop();
    } else if i < 256 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl Registry {
    pub(super) fn notify(&self) {
        let h = self.header();
        // Release: pairs with the Acquire load in `wait_for`; a waiter that sees the new value also
        // sees the slot changes made before it.
        h.notify.fetch_add(1, Ordering::Release);
        // SeqCst fence: pairs with the waiter's SeqCst fence between its `waiters` increment and its
        // `notify` load (a store-load handshake): either we see its increment and wake it, or it sees
        // our new `notify` value and does not sleep. Skips the wake syscall when nobody waits.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        if h.waiters.load(Ordering::Relaxed) != 0 {
            futex::wake_all(&h.notify);
        }
    }

    /// Takes a slot's writer lock, taking it over from a dead holder. Bounded by the lock timeout.
    fn lock_slot(&self, i: u32) -> Result<Taken> {
        self.fork.check("registry handle")?;
        let v = self.view(i);
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        let dead = |t: u64| self.holder_is_dead(t);
        let never = |_: u64| false;
        for n in 0u32.. {
            // Check liveness only now and then: it costs a few system calls.
            let check: &dyn Fn(u64) -> bool = if n % 64 == 63 { &dead } else { &never };
            if let Some(t) = v.try_lock(self.lock_name, check) {
                if matches!(t, Taken::Recovered { .. }) {
                    self.notify();
                }
                return Ok(t);
            }
            if n % 64 == 63 {
                self.lock_wait_checks(&mut slow, deadline, "a registry slot's writer lock")?;
            }
            pause(n);
        }
        unreachable!("the loop returns")
    }

    /// What a lock wait checks every 64th round: whether the registry's name still stands for
    /// this segment (now and then, as `slow` says), and its deadline ([`Error::Timeout`] naming
    /// `what`).
    fn lock_wait_checks(
        &self,
        slow: &mut SlowPath,
        deadline: Instant,
        what: &'static str,
    ) -> Result<()> {
        if slow.due() {
            self.check_superseded()?;
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what,
                after: self.lock_timeout,
            });
        }
        Ok(())
    }

    fn lock_table(&self) -> Result<()> {
        self.fork.check("registry handle")?;
        let w = &self.header().table_lock;
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        for n in 0u32.. {
            // SYNC POINT holder: Acquire, pairs with the Release half of a holder's AcqRel
            // compare-exchange below, so the holder's sealed entry is visible to the check.
            let cur = w.load(Ordering::Acquire);
            let take_from = if cur == 0 {
                Some(0)
            } else if n % 64 == 63 && self.holder_is_dead(cur) {
                Some(cur)
            } else {
                None
            };
            if let Some(from) = take_from {
                // AcqRel: the Acquire half pairs with the Release in `unlock_table` by the
                // previous holder; the Release half with the Acquire load above (SYNC POINT holder).
                if w.compare_exchange(from, self.lock_name, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
            }
            if n % 64 == 63 {
                self.lock_wait_checks(&mut slow, deadline, "the registry's table lock")?;
            }
            pause(n);
        }
        unreachable!("the loop returns")
    }

    fn unlock_table(&self) {
        // Release: pairs with the next locker's Acquire compare-exchange.
        let _ = self.header().table_lock.compare_exchange(
            self.lock_name,
            0,
            Ordering::Release,
            Ordering::Relaxed,
        );
    }

    /// Reads slot `i` consistently. A write left open by a dead writer is recovered (the slot is
    /// freed, `Ok(None)`); a live writer is waited for up to the lock timeout.
    pub(super) fn read_slot(&self, i: u32) -> Result<Option<Record>> {
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        let mut next_liveness = Instant::now();
        loop {
            match v.read(&mut buf, READ_RETRIES) {
                Ok(_) => {
                    return decode(&buf, i).map_err(|what| corrupt(self.name(), what));
                }
                Err(stalled) => {
                    let holder = v.holder();
                    // The holder's liveness costs system calls: at most every millisecond.
                    let now = Instant::now();
                    let look = now >= next_liveness;
                    if look {
                        next_liveness = now + Duration::from_millis(1);
                    }
                    if self.lock_name != 0
                        && (holder == 0 || (look && self.holder_is_dead(holder)))
                        && let Some(t) = v.try_lock(self.lock_name, &|h| self.holder_is_dead(h))
                    {
                        v.unlock(self.lock_name);
                        if matches!(t, Taken::Recovered { .. }) {
                            self.notify();
                        }
                        continue;
                    }
                    if slow.due() {
                        self.check_superseded()?;
                    }
                    if now >= deadline {
                        return Err(stalled.into());
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }

    fn home(&self, name: &str) -> u32 {
        // FNV-1a: where a name's search starts; any slot may hold it.
        let mut h: u32 = 0x811c_9dc5;
        for b in name.bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
        h % self.slots
    }

    fn find(&self, name: &str) -> Result<Option<Record>> {
        let h = self.home(name);
        for k in 0..self.slots {
            let i = (h + k) % self.slots;
            if let Some(r) = self.read_slot(i)?
                && r.name == name
            {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    /// Publishes a new version of record `name`: `kind`, `token` (at most 256 bytes) and `metadata`
    /// (at most 128 bytes), owned by this process. Returns its sequence number, greater than every
    /// earlier number of this name. Wakes every waiter.
    ///
    /// # Errors
    /// [`RegistryError::InvalidName`] / [`RegistryError::TooLarge`] for bad arguments,
    /// [`RegistryError::Full`] when the name is new and no slot is free, [`Error::Timeout`] when a
    /// live process holds the lock longer than the lock timeout, [`RegistryError::Corrupt`] when a
    /// slot's bytes make no sense.
    pub fn publish(&self, name: &str, kind: u32, token: &[u8], metadata: &[u8]) -> Result<u64> {
        validate_record_name(name)?;
        if token.len() > TOKEN_MAX {
            return Err(RegistryError::TooLarge {
                what: "token",
                len: token.len(),
                max: TOKEN_MAX,
            }
            .into());
        }
        if metadata.len() > METADATA_MAX {
            return Err(RegistryError::TooLarge {
                what: "metadata",
                len: metadata.len(),
                max: METADATA_MAX,
            }
            .into());
        }
        loop {
            // Fast path: the name has a slot; update it under its lock.
            if let Some(r) = self.find(name)? {
                if let Some(seq) = self.update_slot(r.slot, name, false, kind, token, metadata)? {
                    return Ok(seq);
                }
                continue;
            }
            // New name: under the table lock, look again, then take a free slot.
            self.lock_table()?;
            let res = self.create_record(name, kind, token, metadata);
            self.unlock_table();
            match res? {
                Some(seq) => return Ok(seq),
                None => continue,
            }
        }
    }

    /// Under the table lock: `Some(seq)` once published, `None` when the name appeared meanwhile.
    fn create_record(
        &self,
        name: &str,
        kind: u32,
        token: &[u8],
        metadata: &[u8],
    ) -> Result<Option<u64>> {
        if self.find(name)?.is_some() {
            return Ok(None);
        }
        let h = self.home(name);
        for k in 0..self.slots {
            let i = (h + k) % self.slots;
            if self.read_slot(i)?.is_some() {
                continue;
            }
            if let Some(seq) = self.update_slot(i, name, true, kind, token, metadata)? {
                return Ok(Some(seq));
            }
        }
        Err(RegistryError::Full {
            name: self.name().to_string(),
            capacity: self.slots,
        }
        .into())
    }

    /// Locks slot `i`, checks it is free (`new`) or still holds `name` (not `new`), and writes the
    /// record. `Ok(None)` when the check failed (the caller looks again).
    fn update_slot(
        &self,
        i: u32,
        name: &str,
        new: bool,
        kind: u32,
        token: &[u8],
        metadata: &[u8],
    ) -> Result<Option<u64>> {
        self.lock_slot(i)?;
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        // We hold the lock and any write left open was repaired while taking it, so the first
        // attempt succeeds unless the bytes are corrupt.
        let cur = v
            .read(&mut buf, 4)
            .map_err(Error::from)
            .and_then(|_| decode(&buf, i).map_err(|what| corrupt(self.name(), what)));
        let fits = match &cur {
            Ok(None) => new,
            Ok(Some(r)) => !new && r.name == name,
            Err(_) => false,
        };
        if !fits {
            v.unlock(self.lock_name);
            return cur.map(|_| None);
        }
        // Relaxed: a read-modify-write of one location is totally ordered, and it runs under the
        // slot lock, so successive writers of a slot take increasing numbers.
        let prev = self.header().next_seq.fetch_add(1, Ordering::Relaxed);
        if prev >= u64::MAX / 2 {
            // No registry counts this far (2^63 publishes); only corrupt bytes get here.
            v.unlock(self.lock_name);
            return Err(corrupt(
                self.name(),
                format!("sequence counter at {prev}, beyond any real count"),
            ));
        }
        let seq = prev + 1;
        let words = encode(name, kind, token, metadata, &self.me, self.uid, seq);
        match v.lock.try_write() {
            Some(w) => {
                for (k, x) in words.iter().enumerate() {
                    w.store(k, *x);
                    if k == PAYLOAD_WORDS / 2 {
                        slot::test_point(Point::WriteHalfStored);
                    }
                }
                w.finish();
            }
            None => {
                v.unlock(self.lock_name);
                return Err(corrupt(
                    self.name(),
                    format!("slot {i}: sequence odd under its writer lock"),
                ));
            }
        }
        v.unlock(self.lock_name);
        self.notify();
        Ok(Some(seq))
    }

    /// The current record `name`, or `None` when there is none. Never returns a torn record.
    ///
    /// # Errors
    /// [`RegistryError::InvalidName`] / [`RegistryError::TooLarge`] for a bad name,
    /// [`ShmError::WriterStalled`](crate::ShmError::WriterStalled) when a live writer held a slot open for the whole lock
    /// timeout, [`RegistryError::Corrupt`] for nonsensical slot bytes.
    pub fn get(&self, name: &str) -> Result<Option<Record>> {
        validate_record_name(name)?;
        self.find(name)
    }

    /// Waits until record `name` has a sequence number greater than `after_seq`, at most `timeout`.
    ///
    /// Sleeps on the registry's shared futex word, re-checking after every wake-up and at least
    /// every 100 ms (a publisher may die between publishing and waking). `after_seq = 0` waits for
    /// any record of that name. `timeout`: how long to wait at most (`Duration::MAX` is fine).
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing newer arrived in time; [`RegistryError::Superseded`] within
    /// about 0.5 s once another segment has the registry's name (the name was removed and made
    /// again: open it again); the errors of [`Registry::get`].
    pub fn wait_for(&self, name: &str, after_seq: u64, timeout: Duration) -> Result<Record> {
        validate_record_name(name)?;
        let deadline = deadline_after(timeout);
        let word = &self.header().notify;
        let mut slow = SlowPath::new();
        loop {
            // Acquire: pairs with the publisher's Release fetch_add in `notify`.
            let v = word.load(Ordering::Acquire);
            if let Some(r) = self.find(name)?
                && r.seq > after_seq
            {
                return Ok(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a newer registry record",
                    after: timeout,
                });
            }
            let waiters = &self.header().waiters;
            // Relaxed increment, then a SeqCst fence: pairs with the publisher's SeqCst fence in
            // `notify`. A waiter that died asleep leaves the count high, which only costs publishers
            // a wake call.
            waiters.fetch_add(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            // Relaxed: ordered after the increment by the fence; the kernel compares it again.
            if word.load(Ordering::Relaxed) == v {
                futex::wait(word, v, (deadline - now).min(Duration::from_millis(100)));
            }
            waiters.fetch_sub(1, Ordering::Relaxed);
            // Slow path only (at most every 250 ms, after a sleep): has the name been given to
            // another segment? Then nobody publishes here any more.
            if slow.due() {
                self.check_superseded()?;
            }
        }
    }

    /// Every published record, in slot order. Never returns a torn record.
    ///
    /// # Errors
    /// As [`Registry::get`].
    pub fn list(&self) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        for i in 0..self.slots {
            if let Some(r) = self.read_slot(i)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Removes record `name`; `true` when there was one. Its sequence numbers are not reused.
    ///
    /// # Errors
    /// As [`Registry::get`], and [`Error::Timeout`] when a live process holds the slot's lock.
    pub fn remove(&self, name: &str) -> Result<bool> {
        validate_record_name(name)?;
        loop {
            let Some(r) = self.find(name)? else {
                return Ok(false);
            };
            if self.free_slot_if(r.slot, |cur| cur.name == name, false)? {
                return Ok(true);
            }
        }
    }

    /// Locks slot `i`; when it holds a record for which `pred` is true (or corrupt bytes and
    /// `free_corrupt`), frees it. Returns whether it freed it.
    pub(super) fn free_slot_if(
        &self,
        i: u32,
        pred: impl Fn(&Record) -> bool,
        free_corrupt: bool,
    ) -> Result<bool> {
        self.lock_slot(i)?;
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        let cur = v
            .read(&mut buf, 4)
            .map_err(Error::from)
            .and_then(|_| decode(&buf, i).map_err(|what| corrupt(self.name(), what)));
        let doit = matches!(&cur, Ok(Some(r)) if pred(r)) || (cur.is_err() && free_corrupt);
        if doit && let Some(w) = v.lock.try_write() {
            for k in 0..PAYLOAD_WORDS {
                w.store(k, 0);
            }
            w.finish();
        }
        v.unlock(self.lock_name);
        if doit {
            self.notify();
        }
        match cur {
            Err(e) if !doit => Err(e),
            _ => Ok(doit),
        }
    }
}
