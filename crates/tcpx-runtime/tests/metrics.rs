//! Metrics: the in-process snapshot and the Prometheus exporter, scraped over HTTP during and
//! after real transfers and parsed with a real parser (`prometheus-parse`); the byte counters
//! must match what moved, within one chunk while transfers run.

mod common;

use std::time::Duration;

use common::*;
use tcpx_runtime::{Config, Endpoint, RemoteSegment, Segment};

const MIB: usize = 1 << 20;
const CHUNK: u32 = 256 << 10;

fn scrape(addr: std::net::SocketAddr) -> prometheus_parse::Scrape {
    let text = ureq::get(&format!("http://{addr}/metrics"))
        .config()
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .call()
        .expect("scrape")
        .body_mut()
        .read_to_string()
        .expect("scrape body");
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parse")
}

/// The sum of `metric` over samples whose labels match every `(key, value)` of `filter`.
fn sum(scrape: &prometheus_parse::Scrape, metric: &str, filter: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| filter.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

#[test]
fn a_scrape_shows_the_bytes_moved_per_connection_and_per_nic() {
    loopback();
    let server_config = Config {
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..config(4, CHUNK)
    };
    let (client, server, cc, sc) = pair_with(config(4, CHUNK), server_config);
    let addr = server.metrics_addr().expect("the exporter runs");
    let conn_id = |s: &prometheus_parse::Scrape| {
        s.samples
            .iter()
            .find(|s| s.metric == "tcpx_channel_received_bytes_total")
            .and_then(|s| s.labels.get("conn").map(str::to_owned))
            .expect("a channel sample")
    };

    let len = 8 * MIB + 3;
    let src = source(&client, len, 11);
    let dst = server.alloc_host(len).unwrap();
    let mut moved = 0usize;
    let mut last = 0.0;
    for round in 0..6 {
        let rx = sc.recv(&dst, 0, len).unwrap();
        let tx = cc.send(&src, 0, len).unwrap();
        // While the message moves: the counter lies between what had landed before it and
        // what will have landed after it (within a chunk of in-flight accounting).
        let during = scrape(addr);
        let conn = conn_id(&during);
        let got = sum(
            &during,
            "tcpx_channel_received_bytes_total",
            &[("conn", &conn)],
        );
        assert!(
            got >= last && got <= (moved + len + CHUNK as usize) as f64,
            "round {round}: {got} received bytes reported, {moved} to {} moved",
            moved + len
        );
        tx.wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        moved += len;
        assert_pattern(&dst, 0, len, 11, "metrics round");

        let after = scrape(addr);
        let per_conn = sum(
            &after,
            "tcpx_channel_received_bytes_total",
            &[("conn", &conn)],
        );
        let per_nic = sum(&after, "tcpx_nic_received_bytes_total", &[("nic", "lo")]);
        for (what, v) in [("connection", per_conn), ("NIC lo", per_nic)] {
            assert!(
                (v - moved as f64).abs() <= CHUNK as f64,
                "round {round}: {what} reports {v} received bytes, {moved} moved"
            );
        }
        last = per_conn;
    }

    // The in-process snapshot agrees, and counts the one connection.
    let m = server.metrics();
    assert_eq!(m.connections_opened, 1);
    assert_eq!(m.connections.len(), 1);
    let total = m.connections[0].total();
    assert!((total.bytes_received as i64 - moved as i64).unsigned_abs() <= u64::from(CHUNK));
    assert_eq!(m.per_nic()["lo"].bytes_received, total.bytes_received);
    let sent = client.metrics().connections[0].total().bytes_sent;
    assert!((sent as i64 - moved as i64).unsigned_abs() <= u64::from(CHUNK));
    let scraped = scrape(addr);
    assert_eq!(
        sum(&scraped, "tcpx_connections_opened_total", &[]),
        1.0,
        "{:?}",
        scraped
            .samples
            .iter()
            .map(|s| &s.metric)
            .collect::<Vec<_>>()
    );

    // Small one-sided writes and reads of host memory travel inline, on no channel: their
    // bytes have counters of their own per connection, in the snapshot and the text.
    let advertised = server.alloc_host(64 << 10).unwrap();
    let d = server.advertise(&advertised).unwrap();
    let small = source(&client, 4096, 12);
    let w = cc
        .write(
            &[Segment::new(&small, 0, 4096)],
            &[RemoteSegment::new(d, 0, 4096)],
            None,
        )
        .unwrap();
    w.wait(DEADLINE).unwrap();
    let back = client.alloc_host(1000).unwrap();
    let r = cc
        .read(
            &[Segment::new(&back, 0, 1000)],
            &[RemoteSegment::new(d, 0, 1000)],
        )
        .unwrap();
    r.wait(DEADLINE).unwrap();
    let inline = server.metrics().connections[0].inline;
    assert_eq!((inline.bytes_received, inline.bytes_sent), (4096, 1000));
    let scraped = scrape(addr);
    assert_eq!(
        sum(&scraped, "tcpx_connection_inline_received_bytes_total", &[]),
        4096.0
    );
    assert_eq!(
        sum(&scraped, "tcpx_connection_inline_sent_bytes_total", &[]),
        1000.0
    );

    // Live plugin registrations: a gauge, the same in the snapshot and the exporter's text.
    let live = server.live_registrations();
    assert!(live > 0, "the server received into a registered region");
    assert_eq!(server.metrics().registrations, live as u64);
    assert_eq!(sum(&scraped, "tcpx_registrations", &[]), live as f64);

    // The exporter ends with its endpoint: nothing listens there afterwards.
    drop((cc, sc, client));
    drop(server);
    // (tiny_http closes its listener on its accept thread, just after the drop returns.)
    assert!(
        eventually(Duration::from_secs(10), || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err()
        }),
        "the metrics port still accepts after the endpoint was dropped"
    );
}

#[test]
fn a_bad_metrics_address_fails_endpoint_creation_with_a_message() {
    loopback();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = Endpoint::new(Config {
        metrics_addr: Some(taken.local_addr().unwrap()),
        ..config(1, CHUNK)
    })
    .unwrap_err();
    assert!(e.to_string().contains("metrics"), "{e}");
    let e = Config::from_vars(|v| (v == "TCPX_METRICS_ADDR").then(|| "nope".into())).unwrap_err();
    assert!(e.to_string().contains("TCPX_METRICS_ADDR"), "{e}");
}
