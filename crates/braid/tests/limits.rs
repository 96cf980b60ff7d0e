//! A world larger than braid supports, or a `Config` built in code with a setting out of its range, is
//! refused up front: an invalid argument naming the limit, before any socket is opened or any
//! shared-memory segment is created.

use std::time::{Duration, Instant};

use braid::{Communicator, Config, UniqueId};

/// Byte offset of the creator's pid in a segment's header.
const H_PID: usize = 20;

/// The braid segments in /dev/shm created by this process (other processes may be making their own).
fn my_segments() -> Vec<String> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("braid-"))
        .filter(|e| {
            std::fs::read(e.path())
                .ok()
                .and_then(|b| b.get(H_PID..H_PID + 4).map(|w| w.try_into().unwrap()))
                .is_some_and(|w: [u8; 4]| u32::from_le_bytes(w) == me)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Initialises rank 1 of `world` and returns the error, checking it came promptly and left no segment.
fn refused(world: usize, config: Config) -> braid::Error {
    let id = UniqueId::new().unwrap();
    let start = Instant::now();
    let err = match Communicator::init(world, 1, &id, config) {
        Ok(_) => panic!("rank 1 of {world} joined: the configuration was accepted"),
        Err(e) => e,
    };
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "refusing took {:?}",
        start.elapsed()
    );
    assert!(
        my_segments().is_empty(),
        "segments left: {:?}",
        my_segments()
    );
    err
}

#[test]
fn oversized_worlds_are_invalid_arguments_naming_the_limit() {
    let config = Config {
        timeout: Duration::from_secs(5),
        ..Config::default()
    };
    // More ranks than the bootstrap's rank table holds.
    let e = refused(65_537, config.clone());
    assert!(e.is_invalid_argument(), "{e:?}");
    assert!(
        e.to_string()
            .contains("nranks 65537 exceeds the maximum 65536"),
        "{e}"
    );
    // With the largest slots, few ranks fit in one shared-memory segment.
    let big = Config {
        chunk_bytes: 64 << 20,
        slots: 64,
        streams: 8,
        ..config.clone()
    };
    let e = refused(16, big.clone());
    assert!(e.is_invalid_argument(), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("nranks 16 exceeds the maximum 7")
            && text.contains("BRAID_CHUNK_BYTES")
            && text.contains("shared-memory segment"),
        "{text}"
    );
    // Over TCP alone, the segment does not limit the world.
    let tcp = Config {
        transport: "tcp".into(),
        timeout: Duration::from_millis(300),
        ..big
    };
    let id = UniqueId::new().unwrap();
    let e = match Communicator::init(16, 1, &id, tcp) {
        Ok(_) => panic!("joined a world nobody else is in"),
        Err(e) => e,
    };
    assert!(!e.is_invalid_argument(), "{e}");
}

#[test]
fn settings_out_of_range_in_a_built_config_are_invalid_arguments() {
    // Short, so that a setting wrongly accepted fails at bootstrap soon rather than in 300 s.
    let d = || Config {
        timeout: Duration::from_secs(5),
        ..Config::default()
    };
    for (config, field) in [
        // Once added to the start of a wait, this deadline would overflow the clock.
        (
            Config {
                timeout: Duration::MAX,
                ..d()
            },
            "timeout",
        ),
        (
            Config {
                chunk_bytes: 0,
                ..d()
            },
            "chunk_bytes",
        ),
        (Config { streams: 0, ..d() }, "streams"),
        (Config { slots: 3, ..d() }, "slots"),
        (
            Config {
                sockets_per_peer: 0,
                transport: "tcp".into(),
                ..d()
            },
            "sockets_per_peer",
        ),
    ] {
        let e = refused(2, config);
        assert!(e.is_invalid_argument(), "{e:?}");
        assert!(e.to_string().contains(field), "{e}");
    }
}
