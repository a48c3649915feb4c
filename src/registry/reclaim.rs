//! Reclaiming what dead processes left: [`Registry::reclaim_dead`] and its report.

use super::slot::Taken;
use super::{Registry, RegistryError};
use crate::error::{Error, Result};
use crate::identity::Liveness;
use crate::shm::ShmError;

/// What [`Registry::reclaim_dead`] freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    /// Published records whose owner is dead, removed.
    pub records: u32,
    /// Half-written records of dead writers (or corrupt slots), dropped.
    pub half_written: u32,
    /// Participant entries of dead processes, freed.
    pub participants: u32,
    /// Records, locks and participant entries kept because whether their process runs could not be
    /// told ([`Liveness::Unknown`], e.g. another user's liveness file): never treated as dead.
    pub kept_unknown: u32,
}

impl Registry {
    /// Frees what dead processes left: their published records, writes they left open, slots whose
    /// bytes are corrupt, and their participant entries. A process is dead only when
    /// [`ProcessIdentity::liveness`](crate::identity::ProcessIdentity::liveness) says [`Liveness::Dead`]; what belongs to a process whose
    /// liveness is unknown is kept and counted in [`ReclaimReport::kept_unknown`].
    ///
    /// A slot whose write a live writer keeps open for the whole lock timeout is skipped.
    ///
    /// # Errors
    /// [`Error::Timeout`] when a live process holds a slot's lock for the whole lock timeout while
    /// a dead owner's record there is to be freed; [`RegistryError::Superseded`] when the name was
    /// given to another segment meanwhile.
    pub fn reclaim_dead(&self) -> Result<ReclaimReport> {
        let mut rep = ReclaimReport::default();
        rep.participants = self.reclaim_participants(&mut rep);
        for i in 0..self.slots {
            let v = self.view(i);
            let holder = v.holder();
            if holder != 0 && holder != self.lock_name {
                match self.holder_liveness(holder).0 {
                    Liveness::Dead => {
                        if let Some(Taken::Recovered { dropped_record }) =
                            v.try_lock(self.lock_name, &|h| self.holder_is_dead(h))
                        {
                            v.unlock(self.lock_name);
                            if dropped_record {
                                rep.half_written += 1;
                            }
                            self.notify();
                        }
                    }
                    Liveness::Alive => {}
                    _ => rep.kept_unknown += 1,
                }
            }
            match self.read_slot(i) {
                Ok(Some(r)) => match r.owner_liveness() {
                    Liveness::Dead => {
                        if self.free_slot_if(i, |cur| cur.seq == r.seq, false)? {
                            rep.records += 1;
                        }
                    }
                    Liveness::Alive => {}
                    _ => rep.kept_unknown += 1,
                },
                Ok(None) => {}
                Err(Error::Registry(RegistryError::Corrupt { .. })) => {
                    if self.free_slot_if(i, |_| false, true)? {
                        rep.half_written += 1;
                    }
                }
                // A write held open by a live (or unknown) writer for the whole lock timeout: not
                // ours to free.
                Err(Error::Shm(ShmError::WriterStalled { .. })) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(rep)
    }
}
