//! A held generation's content: its tensors' digests and fingerprint computed where its bytes
//! lie, and the check against the fingerprint its writer committed ([`content`]).

use super::*;

impl Held<'_> {
    /// The content digest of each tensor of this generation ([`content`]), computed where its
    /// bytes lie: on a GPU set by a kernel on the reader's stream (where the generation is
    /// ready), waiting for it, about one pass over the set's bytes at the device's memory
    /// bandwidth; on a host set on the host.
    ///
    /// # Errors
    /// As [`content::Fingerprinter::digests`] and [`content::Fingerprinter::new`] (the kernel is
    /// loaded at the reader's first call); [`crate::Error::ForkedChild`] in a process forked
    /// from the one that took the hold (as every read of it).
    pub fn tensor_digests(&self) -> Result<Vec<content::TensorDigest>> {
        self.reader.fork.check("tensor set hold")?;
        let n = self.reader.layout.len();
        match &self.reader.memory {
            Memory::Gpu(_) => {
                let stream = self.reader.stream()?;
                let f = content::cached(&self.reader.fingerprinter, stream.context())?;
                let tensors = (0..n)
                    .map(|i| self.device_tensor(i))
                    .collect::<Result<Vec<_>>>()?;
                f.digests(&tensors, stream)
            }
            Memory::Host(d) => {
                // SAFETY: the held buffer of the reader's mapping, alive while the guard is.
                Ok(unsafe { content::host_digests(d.ptr(self.buffer), &self.reader.layout) })
            }
        }
    }

    /// This generation's content fingerprint computed from its bytes
    /// ([`content::set_fingerprint`] over [`Held::tensor_digests`]).
    ///
    /// # Errors
    /// As [`Held::tensor_digests`].
    pub fn fingerprint(&self) -> Result<[u8; 32]> {
        content::set_fingerprint(&self.reader.layout, &self.tensor_digests()?)
    }

    /// Checks this generation's bytes against the content fingerprint its writer committed
    /// ([`crate::tensorset::Update::commit_fingerprinted`]): recomputes it here
    /// ([`Held::fingerprint`]) and compares. A mismatch means the bytes are not what the writer
    /// fingerprinted (written after the commit, corrupted, or a fingerprint the writer computed
    /// otherwise); a generation committed without a fingerprint (all zeros) cannot be verified.
    ///
    /// # Errors
    /// [`TensorSetError::ContentUnverified`] (what the writer committed, what the bytes have);
    /// as [`Held::fingerprint`].
    pub fn verify_content(&self) -> Result<()> {
        let computed = self.fingerprint()?;
        if computed != self.content {
            return Err(TensorSetError::ContentUnverified {
                generation: self.generation,
                committed: self.content,
                computed,
            }
            .into());
        }
        Ok(())
    }
}
