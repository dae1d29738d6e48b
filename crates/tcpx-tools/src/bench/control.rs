//! Small control messages between the two processes of a benchmark (tokens, READY, DONE,
//! verdicts), sent as ordinary two-sided transfers over the tcpx connection itself: no second
//! socket to open, secure or time out, and the messages are ordered with the data.
//!
//! A message is a fixed number of little-endian `u64` words that both sides agree on by
//! protocol; the receiver checks the length it got.

use std::time::{Duration, Instant};

use anyhow::anyhow;
use tcpx_runtime::{Connection, Endpoint, Region};

use super::failure::{peer_failure, Failure};

/// The most words one message carries.
pub const MAX_WORDS: usize = 8;

/// A digest (FNV-1a) of the settings both processes of a benchmark must share, written out as
/// text: the server sends it first and the client refuses to run another plan than its own,
/// with a message naming the options, instead of failing later on a size it did not expect.
pub fn fingerprint(settings: &str) -> u64 {
    settings.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// How often [`Control::recv_watching`] looks for progress.
pub const WATCH: Duration = Duration::from_millis(200);

/// One connection's control channel: a small registered region and the wait limit.
pub struct Control<'c> {
    conn: &'c Connection,
    region: Region,
    timeout: Duration,
}

impl<'c> Control<'c> {
    /// Allocates and registers the message buffer on `conn`.
    pub fn new(
        endpoint: &Endpoint,
        conn: &'c Connection,
        timeout: Duration,
    ) -> Result<Self, Failure> {
        let region = endpoint.alloc_host(MAX_WORDS * 8)?;
        conn.register(&region)?;
        Ok(Self {
            conn,
            region,
            timeout,
        })
    }

    /// Sends `words` and waits until they left.
    pub fn send<const N: usize>(&self, words: [u64; N]) -> Result<(), Failure> {
        let bytes = encode(&words);
        self.region.write(0, &bytes)?;
        self.conn
            .send(&self.region, 0, bytes.len())?
            .wait(self.timeout)
            .map_err(peer_failure)?;
        Ok(())
    }

    /// Receives one message of `N` words; `what` names it in errors ("the server's READY").
    pub fn recv<const N: usize>(&self, what: &str) -> Result<[u64; N], Failure> {
        let len = N * 8;
        let got = self
            .conn
            .recv(&self.region, 0, len)?
            .wait(self.timeout)
            .map_err(|e| {
                peer_failure(anyhow::Error::from(e).context(format!("waiting for {what}")))
            })?;
        self.decode_received(got, what)
    }

    /// [`Control::recv`] for a message that comes after work of unknown length (a whole
    /// timed phase of the peer): waits as long as `moved` — called every [`WATCH`] — keeps
    /// saying that something moved, and gives up once nothing did for the timeout.
    pub fn recv_watching<const N: usize>(
        &self,
        what: &str,
        mut moved: impl FnMut() -> bool,
    ) -> Result<[u64; N], Failure> {
        let transfer = self.conn.recv(&self.region, 0, N * 8)?;
        let mut quiet_since = Instant::now();
        let got = loop {
            match transfer.wait(WATCH.min(self.timeout)) {
                Ok(got) => break got,
                Err(tcpx_runtime::Error::WaitTimedOut(_)) => {
                    if moved() {
                        quiet_since = Instant::now();
                    } else if quiet_since.elapsed() >= self.timeout {
                        return Err(peer_failure(anyhow!(
                            "waiting for {what}: nothing moved for {} s (--timeout)",
                            self.timeout.as_secs_f64()
                        )));
                    }
                }
                Err(e) => {
                    return Err(peer_failure(
                        anyhow::Error::from(e).context(format!("waiting for {what}")),
                    ))
                }
            }
        };
        self.decode_received(got, what)
    }

    fn decode_received<const N: usize>(&self, got: u64, what: &str) -> Result<[u64; N], Failure> {
        const {
            assert!(
                N <= MAX_WORDS,
                "a control message carries at most MAX_WORDS words"
            )
        };
        let len = N * 8;
        if got as usize != len {
            return Err(anyhow!("{what} was {got} bytes, expected {len}").into());
        }
        let mut bytes = vec![0u8; len];
        self.region.read(0, &mut bytes)?;
        Ok(decode(&bytes))
    }
}

/// `words` as little-endian bytes.
pub fn encode<const N: usize>(words: &[u64; N]) -> Vec<u8> {
    const {
        assert!(
            N <= MAX_WORDS,
            "a control message carries at most MAX_WORDS words"
        )
    };
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The first `N` little-endian words of `bytes` (missing bytes read as zero).
pub fn decode<const N: usize>(bytes: &[u8]) -> [u64; N] {
    let mut words = [0u64; N];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    words
}

/// Packs up to `N * 8` bytes into words (for a descriptor's bytes); `None` when they do not fit.
pub fn pack_bytes<const N: usize>(bytes: &[u8]) -> Option<[u64; N]> {
    (bytes.len() <= N * 8).then(|| decode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Control messages come from the peer: any bytes decode (short ones zero-padded),
        /// and words survive encoding.
        #[test]
        fn any_bytes_decode_and_words_round_trip(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80),
            w in proptest::array::uniform7(proptest::num::u64::ANY),
        ) {
            let words: [u64; 7] = decode(&bytes);
            let encoded = encode(&words);
            let n = bytes.len().min(56);
            proptest::prop_assert_eq!(&encoded[..n], &bytes[..n]);
            proptest::prop_assert_eq!(decode::<7>(&encode(&w)), w);
        }
    }

    #[test]
    fn words_round_trip() {
        let w = [1u64, u64::MAX, 0x0102_0304_0506_0708];
        assert_eq!(decode::<3>(&encode(&w)), w);
        let bytes: Vec<u8> = (0..26).collect();
        let packed: [u64; 4] = pack_bytes(&bytes).unwrap();
        assert_eq!(&encode(&packed)[..26], &bytes[..]);
        assert!(pack_bytes::<3>(&bytes).is_none());
    }
}
