//! `BRAID_TOPO_FILE`: the only test in its binary, because it sets the process environment.

mod common;

use braid_topo::{Error, Host, Source, Topology, TOPO_FILE_ENV};
use common::TempDir;

#[test]
fn topology_file_from_the_environment() {
    let dir = TempDir::new("env");
    let path = dir.path().join("t.json");
    let t = Topology::single_host(Host::named("solo"), 3, Source::File).unwrap();
    t.save(&path).unwrap();

    std::env::remove_var(TOPO_FILE_ENV);
    assert!(Topology::from_env(Some(3)).unwrap().is_none());
    std::env::set_var(TOPO_FILE_ENV, "");
    assert!(Topology::from_env(Some(3)).unwrap().is_none());

    std::env::set_var(TOPO_FILE_ENV, &path);
    assert_eq!(Topology::from_env(Some(3)).unwrap(), Some(t.clone()));
    assert_eq!(Topology::from_env(None).unwrap(), Some(t));

    let err = Topology::from_env(Some(4)).unwrap_err();
    assert!(matches!(
        err,
        Error::Env {
            var: "BRAID_TOPO_FILE",
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.starts_with("BRAID_TOPO_FILE: ") && msg.contains("t.json") && msg.contains("rank(s) 3"),
        "{msg}"
    );

    std::env::set_var(TOPO_FILE_ENV, dir.path().join("absent.json"));
    let msg = Topology::from_env(Some(3)).unwrap_err().to_string();
    assert!(
        msg.starts_with("BRAID_TOPO_FILE: cannot read topology file")
            && msg.contains("absent.json"),
        "{msg}"
    );
    std::env::remove_var(TOPO_FILE_ENV);
}
