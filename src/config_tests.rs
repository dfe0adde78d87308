//! Loading and validating whole files: defaults, unknown fields, every section's checks named,
//! the shipped `config.toml` and every `bench/policies/` file.
#![allow(clippy::unwrap_used)]
use super::*;

#[test]
fn empty_file_gives_defaults() {
    let c = Config::from_toml("", "t").unwrap();
    assert_eq!(c.poller.interval_ms, 50);
    assert_eq!(c.listen.port(), 8000);
    assert!(c.validate().is_err(), "no backends must be rejected");
}

#[test]
fn unknown_field_is_named() {
    let err = Config::from_toml("listen = \"127.0.0.1:1\"\nlisten_port = 3\n", "t").unwrap_err();
    assert!(err.to_string().contains("listen_port"), "{err}");
    let err = Config::from_toml("[poller]\ninterval = 3\n", "t").unwrap_err();
    assert!(err.to_string().contains("interval"), "{err}");
    let err =
        Config::from_toml("[[backends]]\nurl = \"http://a:1\"\nweight = 2\n", "t").unwrap_err();
    assert!(err.to_string().contains("weight"), "{err}");
}

#[test]
fn unknown_engine_is_named() {
    let c = Config::from_toml(
        "[[backends]]\nurl = \"http://h:1\"\nengine = \"tgi\"\n",
        "t",
    )
    .unwrap();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("backends[0].engine"));
}

#[test]
fn custom_engine_is_accepted() {
    let c = Config::from_toml(
        "[engines.tgi]\nwaiting = [\"tgi_queue_size\"]\n[[backends]]\nurl = \"http://h:1\"\nengine = \"tgi\"\n",
        "t",
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(
        c.engine("tgi").unwrap().waiting,
        vec!["tgi_queue_size".to_owned()]
    );
}

/// Each section's `validate` is run, and its error names the field's full path.
#[test]
fn every_section_is_validated_and_named() {
    let base = "[[backends]]\nurl = \"http://h:1\"\n";
    Config::from_toml(base, "t").unwrap().validate().unwrap();
    for (extra, field) in [
        ("[admin]\ndecisions = 10001\n", "admin.decisions"),
        ("[discovery]\nsource = \"dns\"\n", "discovery.dns.name"),
        (
            "[[backends]]\nurl = \"http://h:2\"\nrole = \"decoder\"\n",
            "backends[1].role",
        ),
        (
            "[discovery.backend_defaults]\nrole = \"prefil\"\n",
            "discovery.backend_defaults.role",
        ),
        ("[kv_events]\nquiet_ms = 0\n", "kv_events.quiet_ms"),
        ("[pd]\nprefill_timeout_ms = 0\n", "pd.prefill_timeout_ms"),
        (
            "[pd]\nmax_prefill_queue_tokens = 0\n",
            "pd.max_prefill_queue_tokens",
        ),
        (
            "[outlier_detection]\nmax_ejection_percent = 101\n",
            "outlier_detection.max_ejection_percent",
        ),
        ("[poller]\ntimeout_ms = 0\n", "poller.timeout_ms"),
        ("[forward]\nmax_attempts = 0\n", "forward.max_attempts"),
        ("[auth]\nburst = -1.0\n", "auth.burst"),
        (
            "[server]\nmax_header_bytes = 100\n",
            "server.max_header_bytes",
        ),
        ("[limits]\nmax_messages = 0\n", "limits.max_messages"),
        ("[priority]\nmax_class = \"gold\"\n", "priority.max_class"),
        ("max_body_bytes = 0\n", "max_body_bytes"),
        ("session_header = \"bad header\"\n", "session_header"),
    ] {
        let text = if extra.starts_with('[') {
            format!("{base}{extra}")
        } else {
            format!("{extra}{base}")
        };
        let err = Config::from_toml(&text, "t")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(
            err.to_string().contains(&format!("`{field}`")),
            "{extra}: {err}"
        );
    }
}

#[test]
fn bad_header_name_is_rejected() {
    let c = Config::from_toml(
        "backend_header = \"bad header\"\n[[backends]]\nurl = \"http://h:1\"\n",
        "t",
    )
    .unwrap();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("backend_header"));
}

mod shipped {
    #![allow(clippy::unwrap_used)]
    use crate::config::{BackendConfig, Config};

    #[test]
    fn shipped_config_toml_is_valid_and_matches_defaults() {
        let text = include_str!("../config.toml");
        let c = Config::from_toml(text, "config.toml").unwrap();
        c.validate().unwrap();
        crate::scheduling::profile::build_active(c.scheduling()).unwrap();
        let d = Config::default();
        assert_eq!(c.listen, d.listen);
        assert_eq!(c.max_body_bytes, d.max_body_bytes);
        assert_eq!(c.backend_header, d.backend_header);
        assert_eq!(c.session_header, d.session_header);
        assert_eq!(c.session_from_user, d.session_from_user);
        assert_eq!(c.server, d.server);
        assert_eq!(c.poller, d.poller);
        assert_eq!(c.forward, d.forward);
        assert_eq!(c.limits, d.limits);
        assert_eq!(c.outlier_detection, d.outlier_detection);
        assert_eq!(c.auth, d.auth);
        assert_eq!(c.priority, d.priority);
    }

    /// Every policy `loadgen compare` runs (`bench/policies/*.toml`, fragments that loadgen
    /// completes with the backends) loads, validates and builds its active profile.
    #[test]
    fn bench_policies_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/policies");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let mut c = Config::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
            c.backends = vec![BackendConfig::from_url("http://127.0.0.1:9")];
            let built = c
                .validate()
                .and_then(|()| crate::scheduling::profile::build_active(c.scheduling()));
            if let Err(e) = built {
                panic!("{}: {e}", path.display());
            }
            seen += 1;
        }
        assert!(seen >= 20, "only {seen} policies under {}", dir.display());
    }
}
