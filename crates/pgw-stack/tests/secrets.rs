//! No secret appears in any Debug, log line or telemetry record.

use std::io::Write;
use std::sync::{Arc, Mutex};

use pgw_core::openai::ChatRequest;
use pgw_sim::config::LogNormal;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};

const KEY: &str = "sk-grep-me-SECRET-9f8e7d6c";
const WRONG_KEY: &str = "sk-grep-me-WRONG-1a2b3c4d";

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_key_never_prints() {
    let logs = Buf::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let quick = LogNormal {
        median: 0.01,
        p95: 0.02,
        min: 0.005,
        max: 0.03,
    };
    let sim = |name: &str| pgw_sim::SourceConfig {
        api_key: Some(KEY.into()),
        ttft_s: quick.into(),
        error_latency_s: quick.into(),
        tokens_per_second: LogNormal {
            median: 2000.0,
            p95: 3000.0,
            min: 1000.0,
            max: 4000.0,
        }
        .into(),
        ..pgw_sim::SourceConfig::healthy(name)
    };
    let pool = SimPool::new(PoolConfig::of(vec![sim("good"), sim("rejects")]), 3).unwrap();
    let (_, server) = pgw_sim::http::serve(pool.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();

    let dir = std::env::temp_dir().join(format!("pgw-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jsonl = dir.join("attempts.jsonl");
    let mut cfg = GatewayConfig::default();
    cfg.telemetry.jsonl_path = Some(jsonl.display().to_string());
    cfg.telemetry.tracing = true;
    cfg.balance.policy = Some("round_robin".into());
    // "rejects" is configured with a key the provider refuses: a 401 whose message
    // may echo it.
    cfg.sources.push(SourceConfig::new(
        "rejects",
        server.base_url("rejects"),
        SecretKey::new(WRONG_KEY),
    ));
    cfg.sources.push(SourceConfig::new(
        "good",
        server.base_url("good"),
        SecretKey::new(KEY),
    ));
    let sink = MemorySink::new();
    let gw = Gateway::builder(cfg.clone())
        .sink(Arc::new(sink.clone()))
        .build()
        .await
        .unwrap();

    for i in 0..3 {
        gw.chat(ChatRequest::user("m", format!("q{i}"))).await.unwrap();
    }
    // A call that fails everywhere, for its error text.
    let mut only_bad = GatewayConfig::default();
    only_bad.sources.push(SourceConfig::new(
        "rejects",
        server.base_url("rejects"),
        SecretKey::new(WRONG_KEY),
    ));
    let bad = Gateway::from_config(only_bad).await.unwrap();
    let err = bad.chat(ChatRequest::user("m", "x")).await.unwrap_err();

    let records = sink.records();
    assert!(
        records.iter().any(|r| r.outcome == "source_dead"),
        "the 401 happened"
    );
    let everything = format!(
        "{gw:?}\n{cfg:?}\n{:?}\n{err}\n{err:?}\n{records:?}\n{}\n{}\n{}",
        cfg.sources,
        serde_json::to_string(&records).unwrap(),
        std::fs::read_to_string(&jsonl).unwrap(),
        String::from_utf8_lossy(&logs.0.lock().unwrap()),
    );
    assert!(everything.contains("attempt"), "logs were captured");
    assert!(everything.contains("401"), "the refusal is visible");
    for secret in [KEY, WRONG_KEY, "SECRET-9f8e", "WRONG-1a2b"] {
        assert!(!everything.contains(secret), "{secret} leaked");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A credential in a source's base URL (user info, a `?key=` of a gateway that takes
/// one) is hidden wherever the URL is printed: `SourceConfig`'s `Debug` (what `pgw
/// check` prints), the client's settings, an invalid URL's error. A key written as a
/// bare number in TOML is not quoted by its type error.
#[test]
fn a_secret_in_a_base_url_or_a_numeric_key_never_prints() {
    let url = "https://user:tok-SECRET-1@llm.test/v1?api-version=2024-06-01&key=AIza-SECRET-2";
    let source = SourceConfig::new("s1", url, SecretKey::new(KEY));
    let settings = pgw_client::SourceSettings::new("s1", url);
    let bad = pgw_client::SourceSettings::new("s1", "ftp://user:tok-SECRET-1@llm.test/v1?key=AIza-SECRET-2");
    let texts = [
        format!("{source:?}"),
        format!("{settings:?}"),
        bad.endpoint().unwrap_err().to_string(),
    ];
    for text in &texts {
        assert!(!text.contains("SECRET"), "{text}");
    }
    assert!(texts[0].contains("api-version=2024-06-01"), "{}", texts[0]);
    let err = GatewayConfig::from_toml_str(
        "[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = 8231945712345\n",
    )
    .unwrap_err();
    let text = format!("{err} / {err:?}");
    assert!(!text.contains("8231945712345"), "{text}");
    assert!(text.contains("integer (value not shown)"), "{text}");
    // A Redis URL given where a variant name goes (`backend = $REDIS_URL`).
    let err = GatewayConfig::from_toml_str(
        "backend = \"redis://:hunter2-SECRET@cache.test:6379\"\n[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"k\"\n",
    )
    .unwrap_err();
    let text = format!("{err} / {err:?}");
    assert!(!text.contains("SECRET"), "{text}");
    assert!(text.contains("unknown variant (value not shown)"), "{text}");
    // An `@` in the query is not taken for the end of user info with the key after it.
    let url = "https://llm.test/v1?user=ops@corp.test&key=AIza-SECRET-3";
    let text = format!("{:?}", SourceConfig::new("s1", url, SecretKey::new(KEY)));
    assert!(!text.contains("SECRET"), "{text}");
}
