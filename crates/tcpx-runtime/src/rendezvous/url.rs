//! Store URLs: `etcd://host:port[,host:port…]/job[?ttl=SECONDS]`.

use std::time::Duration;

use super::StoreError;

/// The lease TTL when the URL names none: a dead endpoint's keys are gone this long after
/// its last keep-alive.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// An etcd v3 cluster.
    Etcd {
        /// `http://host:port`, one per member given.
        endpoints: Vec<String>,
        /// Every key goes under this prefix: `tcpx/<job>/`.
        prefix: String,
        /// The lease's time to live.
        ttl: Duration,
    },
}

impl StoreUrl {
    /// Parses `url`; every error names the URL and what is wrong with it.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let bad = |what: &str| StoreError::Url {
            url: url.to_owned(),
            what: what.to_owned(),
        };
        let Some(rest) = url.strip_prefix("etcd://") else {
            return Err(bad("unknown scheme: expected etcd://host:port/job"));
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (hosts, job) = rest
            .split_once('/')
            .ok_or_else(|| bad("no job: expected etcd://host:port/job"))?;
        let job = job.trim_matches('/');
        if job.is_empty() {
            return Err(bad("the job (the path after host:port) is empty"));
        }
        if job.chars().any(|c| c.is_control() || c == '?' || c == '#') {
            return Err(bad("the job contains a control character, '?' or '#'"));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let (name, port) = host
                .rsplit_once(':')
                .ok_or_else(|| bad(&format!("member {host:?} has no port")))?;
            if name.is_empty() || name.contains(['@', '/']) {
                return Err(bad(&format!("member {host:?} has no usable host")));
            }
            port.parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| bad(&format!("member {host:?}: port {port:?} is not 1-65535")))?;
            endpoints.push(format!("http://{host}"));
        }
        let mut ttl = DEFAULT_TTL;
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some(("ttl", v)) => {
                    let secs: u64 = v
                        .parse()
                        .ok()
                        .filter(|&s| (1..=3600).contains(&s))
                        .ok_or_else(|| bad(&format!("ttl {v:?} is not 1-3600 seconds")))?;
                    ttl = Duration::from_secs(secs);
                }
                _ => return Err(bad(&format!("unknown parameter {pair:?} (known: ttl)"))),
            }
        }
        Ok(Self::Etcd {
            endpoints,
            prefix: format!("tcpx/{job}/"),
            ttl,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn etcd_urls_name_members_job_and_ttl() {
        assert_eq!(
            StoreUrl::parse("etcd://127.0.0.1:2379/job1").unwrap(),
            StoreUrl::Etcd {
                endpoints: vec!["http://127.0.0.1:2379".into()],
                prefix: "tcpx/job1/".into(),
                ttl: DEFAULT_TTL,
            }
        );
        assert_eq!(
            StoreUrl::parse("etcd://a:1,[::1]:2/x/y/?ttl=3").unwrap(),
            StoreUrl::Etcd {
                endpoints: vec!["http://a:1".into(), "http://[::1]:2".into()],
                prefix: "tcpx/x/y/".into(),
                ttl: Duration::from_secs(3),
            }
        );
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, says) in [
            ("redis://h:1/j", "scheme"),
            ("etcd://h:1", "no job"),
            ("etcd://h:1/", "empty"),
            ("etcd://h/j", "no port"),
            ("etcd://h:0/j", "1-65535"),
            ("etcd://h:99999/j", "1-65535"),
            ("etcd://:1/j", "no usable host"),
            ("etcd://h:1/j?ttl=0", "ttl"),
            ("etcd://h:1/j?x=1", "unknown parameter"),
        ] {
            let e = StoreUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(url), "{url}: {e}");
        }
    }

    proptest! {
        /// Whatever the text, parsing answers (never panics), and what it accepts names at
        /// least one member and a prefix under `tcpx/`.
        #[test]
        fn parsing_never_panics(text in "(etcd://)?[a-z0-9:,./?=&\\[\\]@-]{0,40}") {
            if let Ok(StoreUrl::Etcd { endpoints, prefix, .. }) = StoreUrl::parse(&text) {
                prop_assert!(!endpoints.is_empty());
                prop_assert!(prefix.starts_with("tcpx/") && prefix.ends_with('/'));
            }
        }
    }
}
