//! Reclaiming what dead processes left: [`Registry::reclaim_dead`] and its report, and
//! [`Registry::reclaim_dead_listed`], which also says what it freed, one item each.

use super::slot::Taken;
use super::{Registry, RegistryError};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
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

/// One thing [`Registry::reclaim_dead_listed`] freed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reclaimed {
    /// A published record whose owner is dead, removed.
    Record {
        /// The slot it was in.
        slot: u32,
        /// Its sequence number.
        seq: u64,
        /// Its name.
        name: String,
        /// The dead process that published it.
        owner: ProcessIdentity,
    },
    /// A slot's writer lock left by a dead writer, taken over and released.
    Lock {
        /// The slot.
        slot: u32,
        /// The dead writer's pid (in its own pid namespace; 0 when its entry was freed already).
        writer_pid: u32,
        /// Whether a half-written record was dropped with it.
        dropped_record: bool,
    },
    /// A slot whose bytes were corrupt (or whose write was left open with no writer), freed.
    CorruptSlot {
        /// The slot.
        slot: u32,
    },
    /// A participant entry of a dead process, freed.
    Participant {
        /// The entry index.
        index: u32,
        /// The dead process's pid (in its own pid namespace).
        pid: u32,
    },
}

impl Registry {
    /// The participant entries of dead processes this handle freed when it joined (what
    /// [`Registry::open`] and [`Registry::create`] promise, before any [`Registry::reclaim_dead`]);
    /// empty when there were none.
    pub fn reclaimed_on_open(&self) -> &[Reclaimed] {
        &self.freed_on_join
    }

    /// [`Registry::reclaim_dead`], also returning each thing it freed (for `cuda-ipc gc`,
    /// through [`crate::cleanup`], which reports exactly what was removed).
    ///
    /// # Errors
    /// As [`Registry::reclaim_dead`].
    pub fn reclaim_dead_listed(&self) -> Result<(ReclaimReport, Vec<Reclaimed>)> {
        let mut freed = Vec::new();
        let rep = self.reclaim(&mut freed)?;
        Ok((rep, freed))
    }

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
        self.reclaim(&mut Vec::new())
    }

    /// The one reclaim: [`Registry::reclaim_dead`], pushing what it frees to `freed`.
    fn reclaim(&self, freed: &mut Vec<Reclaimed>) -> Result<ReclaimReport> {
        let mut rep = ReclaimReport::default();
        rep.participants = self.reclaim_participants(&mut rep, freed);
        for i in 0..self.slots {
            let v = self.view(i);
            let holder = v.holder();
            if holder != 0 && holder != self.lock_name {
                let (liveness, writer) = self.holder_liveness(holder);
                match liveness {
                    Liveness::Dead => {
                        if let Some(Taken::Recovered { dropped_record }) =
                            v.try_lock(self.lock_name, &|h| self.holder_is_dead(h))
                        {
                            v.unlock(self.lock_name);
                            if dropped_record {
                                rep.half_written += 1;
                            }
                            freed.push(Reclaimed::Lock {
                                slot: i,
                                writer_pid: writer.map_or(0, |w| w.pid),
                                dropped_record,
                            });
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
                            freed.push(Reclaimed::Record {
                                slot: i,
                                seq: r.seq,
                                name: r.name,
                                owner: r.owner,
                            });
                        }
                    }
                    Liveness::Alive => {}
                    _ => rep.kept_unknown += 1,
                },
                Ok(None) => {}
                Err(Error::Registry(RegistryError::Corrupt { .. })) => {
                    if self.free_slot_if(i, |_| false, true)? {
                        rep.half_written += 1;
                        freed.push(Reclaimed::CorruptSlot { slot: i });
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
