//! Virtual API keys: what a client presents, checked against SHA-256 hashes in the
//! config, each with its allowed models and its own quota (requests, tokens and
//! concurrent calls per window) enforced by a `tower_ratelimit_redis::RateLimiter` on
//! the gateway's backend, so a tenant's quota holds across every replica sharing the
//! Redis.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_core::redis_conn::RedisTarget;
use pgw_core::{BoxError, QuotaExceeded};
use pgw_stack::{BackendKind, GatewayConfig};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_ratelimit_redis::{
    Backend, MemoryBackend, Permit, Quota, RateLimitConfig, RateLimiter, RedisBackend, Renewal,
};

use crate::config::KeyConfig;

/// The SHA-256 of `key` as 64 lowercase hex digits: what `[[server.keys]] sha256` holds.
///
/// ```
/// assert_eq!(
///     pgw_server::hash_key("test"),
///     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
/// );
/// ```
#[must_use]
pub fn hash_key(key: &str) -> String {
    use std::fmt::Write;
    Sha256::digest(key.as_bytes())
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// One tenant: a virtual key's label, models and quota.
pub struct Tenant {
    /// The key's label.
    pub label: Arc<str>,
    /// The models the key may use; `None`: every model.
    models: Option<pgw_stack::AllowedModels>,
    limiter: Option<RateLimiter>,
    /// The key's `max_concurrency` on this process: taken before the server's own
    /// in-flight slot and the body read ([`Tenant::local_slot`]).
    slots: Option<Arc<Semaphore>>,
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenant")
            .field("label", &self.label)
            .field("models", &self.models)
            .finish_non_exhaustive()
    }
}

impl Tenant {
    /// Whether this tenant may name `model`.
    #[must_use]
    pub fn may_use(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.permits(model))
    }

    /// One of the key's `max_concurrency` slots on this process, held as the server's
    /// in-flight slot is (from before the body is read to the answer's end); `Ok(None)`
    /// for a key without `max_concurrency`. Every replica's calls of the key count
    /// against its quota, so a process already holding `max_concurrency` of them
    /// would be refused by the quota too: refused here before the body is read, a key
    /// trickling bodies cannot take the server's in-flight slots from the other keys
    /// (they were taken first, the quota asked only once a body was read).
    ///
    /// # Errors
    /// `QuotaExceeded` (concurrency) with `retry_after`, when every slot is held.
    pub fn local_slot(&self, retry_after: Duration) -> Result<Option<OwnedSemaphorePermit>, BoxError> {
        let Some(slots) = &self.slots else {
            return Ok(None);
        };
        match Arc::clone(slots).try_acquire_owned() {
            Ok(p) => Ok(Some(p)),
            Err(_) => Err(Box::new(
                QuotaExceeded::new("concurrency", retry_after).with_scope(format!("tenant:{}", self.label)),
            )),
        }
    }

    /// Whether the tenant has a model list (else every model).
    #[must_use]
    pub fn models(&self) -> &[String] {
        self.models.as_ref().map_or(&[], |m| &m.0)
    }

    /// The key's model list as the gateway takes it on a call (so a fallback chain
    /// does not lead to a model the key may not use); `None` without a list.
    #[must_use]
    pub fn allowed_models(&self) -> Option<pgw_stack::AllowedModels> {
        self.models.clone()
    }

    /// Admits one call of `request` under the tenant's quota (shedding: refused at once
    /// with `QuotaExceeded { retry_after }`). `None` when the tenant has no quota.
    ///
    /// # Errors
    /// `QuotaExceeded`, `RequestTooLarge` or `BackendUnavailable` from the limiter.
    pub async fn admit(&self, request: &ChatRequest) -> Result<Option<TenantPermit>, BoxError> {
        match &self.limiter {
            None => Ok(None),
            Some(l) => {
                let permit = l.acquire(request.estimate_tokens()).await?;
                Ok(Some(TenantPermit {
                    renewal: permit.renewal(),
                    permit,
                }))
            }
        }
    }
}

/// A tenant's admission of one call: its permit, whose concurrency lease is renewed
/// while the call runs (a stream longer than `ratelimit.lease_ttl_s` keeps its slot).
/// Dropped unfinished (the client went away), the lease is released and the request
/// and its tokens stay charged.
#[derive(Debug)]
pub struct TenantPermit {
    permit: Permit,
    renewal: Renewal,
}

impl TenantPermit {
    /// The call is done and used `used_tokens` (when the provider said): the token
    /// reservation is reconciled, the lease released. Awaited only with a lease (a
    /// strictly sequential client of a concurrency quota must find its slot free at
    /// its next call, on any replica); without one the settle is sent and not waited
    /// for, so the answer does not wait for a Redis round trip.
    pub async fn finish(self, used_tokens: Option<u64>) {
        drop(self.renewal);
        if self.permit.has_lease() {
            // A backend failure is logged and counted by the limiter; the lease expires.
            let _ = self.permit.finish(used_tokens).await;
        } else {
            self.permit.finish_detached(used_tokens);
        }
    }

    /// The call failed with `e`: given back to the tenant's quota (the request and
    /// its tokens) when it reached no provider (open circuits, full pool quotas, an
    /// unknown model: a client retrying those must not spend its own quota on them),
    /// else kept as for a call that ran. Awaited only with a lease, as
    /// [`finish`](Self::finish).
    pub async fn failed(self, e: &BoxError) {
        drop(self.renewal);
        let refund = !crate::error::reached_a_provider(e);
        match (self.permit.has_lease(), refund) {
            (true, false) => drop(self.permit.finish(None).await),
            (true, true) => drop(self.permit.refund().await),
            (false, false) => self.permit.finish_detached(None),
            (false, true) => self.permit.refund_detached(),
        }
    }
}

/// Every virtual key, by hash.
#[derive(Default)]
pub struct KeyRing {
    by_hash: HashMap<String, Arc<Tenant>>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRing")
            .field("keys", &self.by_hash.len())
            .finish()
    }
}

impl KeyRing {
    /// The tenants of `keys`, their limiters on the gateway's backend (`memory`, or the
    /// gateway's Redis under its key prefix, `{prefix}:tenant`).
    ///
    /// # Errors
    /// A limiter configuration error, or Redis unreachable.
    pub async fn new(keys: &[KeyConfig], gateway: &GatewayConfig) -> Result<Self, BoxError> {
        let needs_quota = keys.iter().any(|k| {
            [k.rpm, k.tpm, k.max_concurrency]
                .iter()
                .any(|v| v.is_some_and(|v| v > 0))
        });
        let backend: Option<Backend> = match (needs_quota, gateway.backend) {
            (false, _) => None,
            (true, BackendKind::Memory) => Some(MemoryBackend::new().into()),
            (true, BackendKind::Redis) => {
                let url = gateway.redis_url.as_deref().unwrap_or_default();
                let target = RedisTarget::parse(url).map_err(|e| -> BoxError { e.into() })?;
                Some(RedisBackend::connect(&target).await?.into())
            }
        };
        let prefix = format!(
            "{}:tenant",
            gateway
                .key_prefix
                .as_deref()
                .unwrap_or(pgw_stack::config::DEFAULT_KEY_PREFIX)
        );
        let window = gateway
            .ratelimit
            .window_s
            .map_or(tower_ratelimit_redis::DEFAULT_WINDOW, Duration::from_secs_f64);
        let lease_ttl = gateway
            .ratelimit
            .lease_ttl_s
            .map_or(tower_ratelimit_redis::DEFAULT_LEASE_TTL, Duration::from_secs_f64);
        let mut by_hash = HashMap::new();
        for k in keys {
            let nonzero = |v: Option<u64>| v.filter(|&v| v > 0);
            let quota = Quota {
                requests: nonzero(k.rpm),
                tokens: nonzero(k.tpm),
                concurrency: nonzero(k.max_concurrency),
            };
            let limiter = match &backend {
                Some(b) if quota != Quota::unlimited() => Some(RateLimiter::new(
                    RateLimitConfig::new(format!("tenant:{}", k.label), quota)
                        .key_prefix(prefix.clone())
                        .window(window)
                        .lease_ttl(lease_ttl),
                    b.clone(),
                )?),
                _ => None,
            };
            by_hash.insert(
                k.sha256.to_ascii_lowercase(),
                Arc::new(Tenant {
                    label: k.label.as_str().into(),
                    models: (!k.models.is_empty())
                        .then(|| pgw_stack::AllowedModels(k.models.as_slice().into())),
                    limiter,
                    slots: nonzero(k.max_concurrency).map(|n| {
                        Arc::new(Semaphore::new(
                            usize::try_from(n).unwrap_or(Semaphore::MAX_PERMITS),
                        ))
                    }),
                }),
            );
        }
        Ok(Self { by_hash })
    }

    /// Whether any key is configured (else the server is open).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The tenant of the presented key, if it is one of ours.
    #[must_use]
    pub fn find(&self, presented: &str) -> Option<Arc<Tenant>> {
        self.by_hash.get(&hash_key(presented)).cloned()
    }

    /// The tenant of a request's `Authorization: Bearer` (or `api-key`) header.
    #[must_use]
    pub fn authenticate(&self, headers: &http::HeaderMap) -> Option<Arc<Tenant>> {
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                // The scheme is case-insensitive (RFC 9110 11.1): `BEARER k` too.
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(rest)
            })
            .map(str::trim);
        let key = bearer.or_else(|| headers.get("api-key").and_then(|v| v.to_str().ok()))?;
        self.find(key)
    }
}
