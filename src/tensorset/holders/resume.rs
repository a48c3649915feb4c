//! Whether a writer created under the name of a dead writer's held set resumes on its memory or
//! replaces it: a pure decision from what the holders segment's header records
//! ([`HoldersSegment::memory_facts`](super::HoldersSegment::memory_facts)) and what the new writer
//! asks for.

/// What a holders segment's header records of the set's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemoryFacts {
    /// The layout fingerprint (32 bytes).
    pub(crate) fingerprint: [u8; 32],
    /// Bytes per buffer.
    pub(crate) bytes_per_buffer: u64,
    /// Buffers B.
    pub(crate) buffers: usize,
    /// Allocations per buffer A.
    pub(crate) allocations: usize,
}

/// What the old set looks like now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    /// The memory facts of its holders segment.
    pub(crate) facts: MemoryFacts,
    /// Whether its writer (the manifest's) is dead.
    pub(crate) writer_dead: bool,
    /// Live holders (serving, other than a writer).
    pub(crate) live_holders: usize,
    /// Whether a whole generation is recorded.
    pub(crate) whole: bool,
}

/// The decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Re-attach to the held memory.
    Resume,
    /// Replace the set as a new one (why).
    Replace(&'static str),
}

/// Whether a new writer asking for `asked` (the memory facts of its layout and mode) with
/// resuming `allowed` resumes on `found`. Resumes only when everything matches: the writer dead,
/// a live holder, a whole generation, the same fingerprint, bytes per buffer, buffers and
/// allocations.
pub(crate) fn decide(asked: &MemoryFacts, allowed: bool, found: &Found) -> Decision {
    if !allowed {
        return Decision::Replace("resuming was turned off (TensorSetOptions::resume(false))");
    }
    if !found.writer_dead {
        return Decision::Replace("the old writer is not dead");
    }
    if found.live_holders == 0 {
        return Decision::Replace("no live holder keeps the old memory");
    }
    if !found.whole {
        return Decision::Replace("the old set has no whole generation");
    }
    let f = &found.facts;
    if f.fingerprint != asked.fingerprint {
        return Decision::Replace("the layout fingerprint differs");
    }
    if f.bytes_per_buffer != asked.bytes_per_buffer {
        return Decision::Replace("the bytes per buffer differ");
    }
    if f.buffers != asked.buffers {
        return Decision::Replace("the buffer count differs");
    }
    if f.allocations != asked.allocations {
        return Decision::Replace("the allocation count differs");
    }
    Decision::Resume
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> MemoryFacts {
        MemoryFacts {
            fingerprint: [7; 32],
            bytes_per_buffer: 1 << 20,
            buffers: 2,
            allocations: 1,
        }
    }

    fn found() -> Found {
        Found {
            facts: facts(),
            writer_dead: true,
            live_holders: 1,
            whole: true,
        }
    }

    #[test]
    fn a_dead_writers_held_set_of_the_same_layout_is_resumed() {
        assert_eq!(decide(&facts(), true, &found()), Decision::Resume);
    }

    #[test]
    fn resuming_turned_off_replaces() {
        assert!(matches!(
            decide(&facts(), false, &found()),
            Decision::Replace(w) if w.contains("turned off")
        ));
    }

    #[test]
    fn any_difference_in_the_memory_facts_replaces() {
        type Change = fn(&mut MemoryFacts);
        let cases: [(Change, &str); 4] = [
            (|f| f.fingerprint[0] ^= 1, "fingerprint"),
            (|f| f.bytes_per_buffer += 256, "bytes per buffer"),
            (|f| f.buffers = 3, "buffer count"),
            (|f| f.allocations = 2, "allocation count"),
        ];
        for (change, word) in cases {
            let mut asked = facts();
            change(&mut asked);
            match decide(&asked, true, &found()) {
                Decision::Replace(why) => assert!(why.contains(word), "{why}"),
                Decision::Resume => panic!("resumed though the {word} differs"),
            }
        }
    }

    #[test]
    fn no_live_holder_a_live_writer_or_no_whole_generation_replaces() {
        let mut f = found();
        f.live_holders = 0;
        assert_eq!(
            decide(&facts(), true, &f),
            Decision::Replace("no live holder keeps the old memory")
        );
        let mut f = found();
        f.writer_dead = false;
        assert!(matches!(decide(&facts(), true, &f), Decision::Replace(_)));
        let mut f = found();
        f.whole = false;
        assert!(matches!(decide(&facts(), true, &f), Decision::Replace(w) if w.contains("whole")));
    }
}
