//! Token encoding and every kind of bad input. Runs without a GPU.

use cuda_ipc::Error;
use cuda_ipc::driver::Uuid;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::token::{TOKEN_LEN, TOKEN_VERSION, Token, TokenKind};
use proptest::prelude::*;

fn sample() -> Token {
    Token {
        kind: TokenKind::LegacyMemory,
        handle: std::array::from_fn(|i| i as u8),
        offset: 4096,
        len: 1 << 20,
        device: "GPU-3298439a-810e-95f0-e3b8-da8e2434f657".parse().unwrap(),
        exporter: ProcessIdentity {
            pid: 4242,
            start_time: 123_456,
            boot_id: [7; 16],
            pid_ns: 4026531836,
        },
        export_id: 0,
    }
}

fn reseal(b: &mut [u8]) {
    let crc = crc32(&b[..140]);
    b[140..144].copy_from_slice(&crc.to_le_bytes());
}

// The same CRC-32 (IEEE) as the layout documents, computed independently of the crate.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn err(b: &[u8]) -> String {
    match Token::from_bytes(b) {
        Err(Error::InvalidToken(m)) => m,
        other => panic!("expected InvalidToken, got {other:?}"),
    }
}

#[test]
fn token_round_trips_through_bytes_and_hex() {
    let t = sample();
    assert_eq!(Token::from_bytes(&t.to_bytes()).unwrap(), t);
    assert_eq!(Token::from_hex(&t.to_hex()).unwrap(), t);
    assert_eq!(t.to_bytes().len(), TOKEN_LEN);
    let t = Token {
        kind: TokenKind::LegacyEvent,
        ..sample()
    };
    assert_eq!(Token::from_bytes(&t.to_bytes()).unwrap(), t);
    for kind in [TokenKind::VmmMemory, TokenKind::PoolMemory] {
        let t = Token {
            kind,
            export_id: 7,
            ..sample()
        };
        assert_eq!(Token::from_bytes(&t.to_bytes()).unwrap(), t);
        assert_eq!(
            u32::from_le_bytes(t.to_bytes()[108..112].try_into().unwrap()),
            7
        );
    }
}

#[test]
fn token_layout_matches_the_documented_offsets() {
    let b = sample().to_bytes();
    assert_eq!(&b[0..4], b"CIPT");
    assert_eq!(u16::from_le_bytes([b[4], b[5]]), TOKEN_VERSION);
    assert_eq!(u16::from_le_bytes([b[6], b[7]]), 1);
    assert_eq!(b[8], 0);
    assert_eq!(b[71], 63);
    assert_eq!(u64::from_le_bytes(b[72..80].try_into().unwrap()), 4096);
    assert_eq!(u64::from_le_bytes(b[80..88].try_into().unwrap()), 1 << 20);
    assert_eq!(b[88], 0x32);
    assert_eq!(u32::from_le_bytes(b[104..108].try_into().unwrap()), 4242);
    assert_eq!(u64::from_le_bytes(b[112..120].try_into().unwrap()), 123_456);
    assert_eq!(b[120..136], [7; 16]);
    assert_eq!(
        u32::from_le_bytes(b[136..140].try_into().unwrap()),
        4026531836
    );
    assert_eq!(
        u32::from_le_bytes(b[140..144].try_into().unwrap()),
        crc32(&b[..140])
    );
}

#[test]
fn truncated_and_overlong_tokens_are_refused() {
    let b = sample().to_bytes();
    for n in [0, 1, 8, 100, TOKEN_LEN - 1] {
        assert!(err(&b[..n]).contains("expected 144 bytes"));
    }
    let mut long = b.to_vec();
    long.push(0);
    assert!(err(&long).contains("got 145"));
}

#[test]
fn garbage_bytes_are_not_a_token() {
    assert!(err(&[0u8; TOKEN_LEN]).contains("bad magic"));
    assert!(err(&[0xFF; TOKEN_LEN]).contains("bad magic"));
}

#[test]
fn newer_version_is_refused_naming_both_versions() {
    let mut b = sample().to_bytes();
    b[4..6].copy_from_slice(&(TOKEN_VERSION + 1).to_le_bytes());
    reseal(&mut b);
    let m = err(&b);
    assert!(
        m.contains(&format!("version {}", TOKEN_VERSION + 1)) && m.contains("newer"),
        "{m}"
    );
    assert!(m.contains(&format!("reads version {TOKEN_VERSION}")), "{m}");
}

#[test]
fn corrupted_bytes_fail_the_checksum() {
    let good = sample().to_bytes();
    for i in 8..140 {
        let mut b = good;
        b[i] ^= 0x01;
        assert!(err(&b).contains("checksum"), "flip at byte {i}");
    }
}

#[test]
fn unknown_kinds_and_overflowing_ranges_are_refused() {
    let mut b = sample().to_bytes();
    b[6] = 99;
    reseal(&mut b);
    assert!(err(&b).contains("unknown kind 99"));
    // An fd export id on a legacy token, or none on an fd-based one, is refused.
    let mut b = sample().to_bytes();
    b[108] = 1;
    reseal(&mut b);
    assert!(err(&b).contains("fd export id"));
    let t = Token {
        kind: TokenKind::VmmMemory,
        ..sample()
    };
    assert!(err(&t.to_bytes()).contains("fd export id"));
    let t = Token {
        offset: u64::MAX,
        len: 2,
        ..sample()
    };
    assert!(err(&t.to_bytes()).contains("overflows"));
}

#[test]
fn bad_hex_is_refused() {
    assert!(Token::from_hex("abc").is_err());
    assert!(Token::from_hex(&"zz".repeat(TOKEN_LEN)).is_err());
    assert!(Token::from_hex("é").is_err());
    // `u8::from_str_radix` takes a sign: "+0" would read as a byte. Only hex digits are a byte.
    let hex = sample().to_hex();
    let signed: String = hex
        .char_indices()
        .map(|(i, c)| if i % 2 == 0 && c == '0' { '+' } else { c })
        .collect();
    assert_ne!(signed, hex);
    let m = match Token::from_hex(&signed) {
        Err(Error::InvalidToken(m)) => m,
        other => panic!("a signed digit pair was accepted: {other:?}"),
    };
    assert!(m.contains("'+'") && m.contains("at byte"), "{m}");
    // Surrounding whitespace is fine; whitespace inside is not.
    assert_eq!(Token::from_hex(&format!(" {hex}\n")).unwrap(), sample());
    assert!(Token::from_hex(&format!("{} {}", &hex[..2], &hex[2..])).is_err());
    let uuid: Result<Uuid, _> = "GPU-123".parse();
    assert!(uuid.is_err());
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Token::from_bytes(&bytes);
    }

    #[test]
    fn arbitrary_tokens_round_trip(handle in proptest::array::uniform32(any::<u8>()), offset in 0u64..1 << 40,
                                   len in 0u64..1 << 40, pid in any::<u32>(), st in any::<u64>()) {
        let mut t = sample();
        t.handle[..32].copy_from_slice(&handle);
        t.offset = offset;
        t.len = len;
        t.exporter.pid = pid;
        t.exporter.start_time = st;
        prop_assert_eq!(Token::from_bytes(&t.to_bytes()).unwrap(), t);
    }

    #[test]
    fn single_bit_flips_are_detected(pos in 0usize..TOKEN_LEN, bit in 0u8..8) {
        let mut b = sample().to_bytes();
        b[pos] ^= 1 << bit;
        prop_assert!(Token::from_bytes(&b).is_err());
    }
}
