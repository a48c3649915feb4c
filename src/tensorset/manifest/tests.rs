//! The manifest's unit tests: round trips, refused specs and fingerprints, and the decoder fed
//! random and corrupted bodies.

use super::*;
use proptest::prelude::*;

fn sample(n: usize) -> Manifest {
    let specs: Vec<_> = (0..n)
        .map(|i| {
            TensorSpec::new(
                format!("layer.{i}.weight"),
                DType::BF16,
                &[3, (i % 7) as i64 + 1],
            )
        })
        .collect();
    let layout = Layout::new(&specs).unwrap();
    Manifest {
        kind: KIND_HOST,
        flags: FLAG_BUFFERED,
        buffers: 2,
        tokens: vec![vec![[7u8; TOKEN_LEN]]; 2],
        layout,
        channel_generation: 11,
        data_generation: 12,
        max_readers: 64,
        holders_generation: 13,
        generation_base: 41,
    }
}

#[test]
fn offsets_are_aligned_and_the_body_round_trips() {
    let m = sample(5);
    for t in m.layout.tensors() {
        assert_eq!(t.offset % ALIGN, 0);
    }
    assert_eq!(m.layout.tensors()[1].offset, 256);
    assert_eq!(m.layout.tensors()[0].strides, vec![1, 1]);
    let d = decode(&encode(&m)).unwrap();
    assert_eq!(d.layout.tensors(), m.layout.tensors());
    assert_eq!(d.layout.fingerprint(), m.layout.fingerprint());
    assert_eq!(
        (
            d.buffers,
            d.channel_generation,
            d.data_generation,
            d.holders_generation
        ),
        (2, 11, 12, 13)
    );
    // A body written before holders existed (zero at 152) reads as "no holders segment".
    let mut old = encode(&m);
    old[152..160].fill(0);
    assert_eq!(decode(&old).unwrap().holders_generation, 0);
    assert_eq!(d.layout.index_of("layer.3.weight"), Some(3));
}

#[test]
fn a_stored_fingerprint_that_is_not_the_tables_is_refused() {
    let mut body = encode(&sample(40));
    body[96] ^= 1;
    assert!(matches!(decode(&body), Err(ManifestFault::Fingerprint)));
    let m = decode_unverified(&body).unwrap();
    assert_eq!(m.layout.fingerprint()[0], body[96]);
    assert!(matches!(
        m.verify_fingerprint(),
        Err(ManifestFault::Fingerprint)
    ));
    // A tensor's offset changed (the stored fingerprint kept): refused as well.
    let mut body = encode(&sample(40));
    let e = BODY_HEADER + 2 * ALLOC_ENTRY + 3 * TENSOR_ENTRY + 40;
    body[e + 1] ^= 1;
    assert!(matches!(decode(&body), Err(ManifestFault::Fingerprint)));
    // The chunked hash is the per-field one: the digest did not change.
    let m = sample(3000);
    let mut h = Sha256::new();
    h.update(b"cuda-ipc tensor-set layout v1\0");
    h.update((m.layout.len() as u64).to_le_bytes());
    for t in m.layout.tensors() {
        h.update((t.name.len() as u32).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update([t.dtype.code, t.dtype.bits]);
        h.update(t.dtype.lanes.to_le_bytes());
        h.update((t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().chain(&t.strides) {
            h.update(d.to_le_bytes());
        }
        h.update(t.allocation.to_le_bytes());
        h.update(t.offset.to_le_bytes());
    }
    assert_eq!(m.layout.fingerprint(), <[u8; 32]>::from(h.finalize()));
}

#[test]
fn a_hundred_thousand_tensors_round_trip() {
    let m = sample(100_000);
    let body = encode(&m);
    let d = decode(&body).unwrap();
    assert_eq!(d.layout.len(), 100_000);
    assert_eq!(
        d.layout.by_name("layer.99999.weight").unwrap().offset,
        99_999 * 256
    );
}

#[test]
fn bad_specs_are_refused_with_the_tensor_named() {
    let dup = [
        TensorSpec::new("a", DType::F32, &[1]),
        TensorSpec::new("a", DType::F32, &[1]),
    ];
    assert!(Layout::new(&dup).is_err());
    assert!(Layout::new(&[TensorSpec::new("", DType::F32, &[1])]).is_err());
    assert!(Layout::new(&[TensorSpec::new("neg", DType::F32, &[-1])]).is_err());
    assert!(Layout::new(&[TensorSpec::strided("s", DType::F32, &[2, 2], &[1])]).is_err());
    let big = TensorSpec::new("big", DType::F64, &[i64::MAX, i64::MAX]);
    assert!(Layout::new(&[big]).is_err());
    let t = TensorSpec::strided("t", DType::F32, &[2, 3], &[1, 2]);
    assert_eq!(Layout::new(&[t]).unwrap().tensors()[0].bytes, 4 * 6);
    // A fingerprint changes with any offset or name.
    let a = Layout::new(&[TensorSpec::new("x", DType::F32, &[4])]).unwrap();
    let b = Layout::new(&[TensorSpec::new("y", DType::F32, &[4])]).unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
    let over = Layout::with_locations(&[(TensorSpec::new("x", DType::F32, &[4]), 0, 8)], vec![16]);
    assert!(over.is_err());
}

#[test]
fn a_tensor_or_a_set_past_isize_max_bytes_is_refused_with_the_tensor_named() {
    // 2**63 bytes: fits a `u64`, not a mapping nor an `off_t`.
    let e = Layout::new(&[TensorSpec::new("w", DType::F32, &[1 << 61])]).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("\"w\"") && text.contains("9223372036854775808 bytes"),
        "{text}"
    );
    // The largest that fits once aligned.
    let at_most = (MAX_SET_BYTES / ALIGN * ALIGN / 4) as i64;
    assert!(Layout::new(&[TensorSpec::new("w", DType::F32, &[at_most])]).is_ok());
    let two = [
        TensorSpec::new("a", DType::F32, &[1 << 60]),
        TensorSpec::new("b", DType::F32, &[1 << 60]),
    ];
    let text = Layout::new(&two).unwrap_err().to_string();
    assert!(
        text.contains("\"b\"") && text.contains("the set's size passes"),
        "{text}"
    );
}

#[test]
fn row_major_strides_past_i64_max_are_refused_not_saturated_also_with_no_elements() {
    // No elements (a dimension of extent 0), but the stride of dimension 0 is 2^62 × 8 = 2^65
    // elements: it was kept as i64::MAX, a stride the shape does not have.
    let e = Layout::new(&[TensorSpec::new("e", DType::F32, &[0, 1 << 62, 8])]).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("tensor \"e\": ")
            && text.contains("stride of dimension 0")
            && text.contains("[4611686018427387904, 8]")
            && text.contains("i64::MAX"),
        "{text}"
    );
    // Strides that fit, with no elements, are kept exactly; the product of all the extents
    // (2^63 here, which is no stride) is not asked for.
    let l = Layout::new(&[TensorSpec::new("e", DType::F32, &[2, 0, 1 << 61, 2])]).unwrap();
    assert_eq!(l.tensors()[0].strides, vec![1 << 62, 1 << 62, 2, 1]);
    assert_eq!(l.tensors()[0].bytes, 0);
}

#[test]
fn given_allocations_past_isize_max_bytes_in_all_are_refused_not_summed_into_an_overflow() {
    let x = || (TensorSpec::new("x", DType::U8, &[4]), 0, 0);
    // Each allocation alone, and their sum, whether it wraps a `u64` or not.
    for lens in [
        vec![u64::MAX],
        vec![MAX_SET_BYTES + 1],
        vec![u64::MAX, u64::MAX],
        vec![MAX_SET_BYTES, MAX_SET_BYTES],
        vec![1 << 62, 1 << 62],
    ] {
        // `TooManyTensors` naming the sum and the limit.
        let text = Layout::with_locations(&[x()], lens.clone())
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("bytes per buffer") && text.contains(&format!("at most {MAX_SET_BYTES}")),
            "{lens:?}: {text}"
        );
    }
    let l = Layout::with_locations(&[x()], vec![MAX_SET_BYTES - 4096, 4096]).unwrap();
    assert_eq!(l.bytes_per_buffer(), MAX_SET_BYTES);
}

/// The first bytes of `body` an opener copies: the body header, then up to the allocation
/// table's end (as `open_manifest_head` does).
fn head_of(body: &[u8]) -> &[u8] {
    &body[..head_len(body, body.len())]
}

/// The head alone (header and allocation table) decodes as the whole body does, every range
/// checked against the whole body's length; a table past that length, or a head shorter than
/// what it must hold, is refused with the range, never read past.
#[test]
fn the_head_alone_decodes_as_the_whole_body_and_ranges_are_the_bodys() {
    let m = sample(40);
    let body = encode(&m);
    let head = head_of(&body);
    assert!(
        head.len() < body.len() / 4,
        "{} of {}",
        head.len(),
        body.len()
    );
    let (hm, ht) = decode_head_within(head, body.len() as u64).unwrap();
    let (wm, wt) = decode_head(&body).unwrap();
    assert_eq!(hm.tokens, wm.tokens);
    assert_eq!(hm.layout.allocations(), wm.layout.allocations());
    assert_eq!(hm.layout.fingerprint(), wm.layout.fingerprint());
    assert_eq!(
        (hm.channel_generation, hm.generation_base),
        (wm.channel_generation, wm.generation_base)
    );
    assert_eq!(
        ht.decode(&body).unwrap().tensors(),
        wt.decode(&body).unwrap().tensors()
    );
    // The body said to be a byte shorter: its last area no longer fits.
    assert!(matches!(
        decode_head_within(head, body.len() as u64 - 1),
        Err(ManifestFault::OutOfBounds { body: b, .. }) if b == body.len() as u64 - 1
    ));
    // A head cut inside the allocation table: refused, not read past.
    let cut = &head[..head.len() - 1];
    assert!(matches!(
        decode_head_within(cut, body.len() as u64),
        Err(ManifestFault::OutOfBounds { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode(&bytes);
        let _ = decode_head_within(&bytes, bytes.len() as u64 * 2);
    }

    /// Whatever the body, its head as an opener copies it decodes to what the whole body does.
    #[test]
    fn a_corrupted_head_decodes_as_its_whole_body(
        n in 0usize..20,
        flips in proptest::collection::vec((0usize..BODY_HEADER + 2 * ALLOC_ENTRY, any::<u8>()), 1..6),
    ) {
        let mut body = encode(&sample(n));
        for (at, v) in flips {
            let i = at % body.len();
            body[i] ^= v | 1;
        }
        let whole = decode_head(&body).map(|(m, _)| m.tokens);
        let head = decode_head_within(head_of(&body), body.len() as u64).map(|(m, _)| m.tokens);
        prop_assert_eq!(whole.is_ok(), head.is_ok(), "{:?} / {:?}", whole, head);
        if let (Ok(w), Ok(h)) = (whole, head) {
            prop_assert_eq!(w, h);
        }
    }

    #[test]
    fn corrupted_bodies_never_panic_and_are_mostly_refused(
        n in 0usize..20,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut body = encode(&sample(n));
        for (at, v) in flips {
            let i = at % body.len();
            body[i] ^= v | 1;
        }
        let _ = decode(&body);
        let keep = cut % (body.len() + 1);
        let _ = decode(&body[..keep]);
    }
}

/// A NUL byte in a tensor name is refused by the writer's layout and, planted in a manifest, by
/// the reader's decode (with the tensor's index), never handed on to C strings.
#[test]
fn a_nul_byte_in_a_tensor_name_is_refused_on_both_sides() {
    let e = Layout::new(&[TensorSpec::new("a\0b", DType::F32, &[1])]).unwrap_err();
    assert!(e.to_string().contains("NUL"), "{e}");
    let m = sample(3);
    let mut body = encode(&m);
    let name = b"layer.1.weight";
    let at = body
        .windows(name.len())
        .position(|w| w == name)
        .expect("the name lies in the body");
    body[at + 5] = 0;
    let e = decode(&body).unwrap_err();
    assert!(
        matches!(e, ManifestFault::Tensor { index: 1, ref why } if why.contains("NUL")),
        "{e:?}"
    );
}
