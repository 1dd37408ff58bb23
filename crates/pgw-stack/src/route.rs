//! Routes: a source serving one upstream model, the unit the breaker, the health
//! EWMA and 429 holds are kept for; and [`RouteHolds`], the retry layer's hold hook
//! that holds a route, or its account when the provider says the limit is the
//! account's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgw_core::{BoxError, Hold, HoldFuture, SourceId, UpstreamStatus};
use tower_ratelimit_redis::{HoldScope, RateLimiter};

use crate::config::GatewayConfig;

/// One route to build: a source (its index in `sources`), the model sent upstream
/// (`None`: the caller's), and its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RouteSpec {
    pub(crate) source: usize,
    pub(crate) upstream: Option<String>,
    pub(crate) id: SourceId,
}

/// One group of the gateway: a retry loop over a balancer over these routes.
#[derive(Clone, Debug)]
pub(crate) struct GroupSpec {
    pub(crate) name: String,
    pub(crate) routes: Vec<usize>,
}

/// Where the calls for one public model go: group indices, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ModelChain {
    /// The model's own group, then its fallback chain.
    pub(crate) chain: Vec<usize>,
    /// The context-window fallback chain.
    pub(crate) context: Vec<usize>,
    /// Where these chains go (groups, routes, upstream models): part of the cache
    /// key, so a stored answer is not served once the routing changed.
    pub(crate) route_key: String,
}

/// The gateway's shape, read from the config: routes, groups, and (with `[models]`)
/// each public model's chains.
#[derive(Clone, Debug, Default)]
pub(crate) struct Plan {
    pub(crate) routes: Vec<RouteSpec>,
    pub(crate) groups: Vec<GroupSpec>,
    /// Empty without `[models]`: every call walks every group, `all`.
    pub(crate) models: BTreeMap<String, ModelChain>,
    /// Every group in order: the chain without `[models]`.
    pub(crate) all: ModelChain,
}

impl Plan {
    pub(crate) fn of(cfg: &GatewayConfig) -> Self {
        let mut plan = Self::default();
        if cfg.models.is_empty() {
            // Each source is its own route; groups in fallback order.
            for (i, sc) in cfg.sources.iter().enumerate() {
                plan.routes.push(RouteSpec {
                    source: i,
                    upstream: sc.model.clone(),
                    id: SourceId::from(sc.name.as_str()),
                });
            }
            for name in cfg.group_order() {
                let routes = (0..cfg.sources.len())
                    .filter(|&i| cfg.sources[i].group_name() == name)
                    .collect();
                plan.groups.push(GroupSpec { name, routes });
            }
            let chain = (0..plan.groups.len()).collect();
            plan.all = plan.chain(chain, Vec::new());
            return plan;
        }
        for (name, model) in &cfg.models {
            let mut routes = Vec::new();
            for r in &model.routes {
                let Some(source) = cfg.sources.iter().position(|s| s.name == r.source) else {
                    continue; // refused by validation
                };
                let upstream = r.upstream_model(name, cfg.sources[source].model.as_deref());
                let index = match plan
                    .routes
                    .iter()
                    .position(|x| x.source == source && x.upstream.as_deref() == Some(upstream))
                {
                    Some(i) => i,
                    None => {
                        plan.routes.push(RouteSpec {
                            source,
                            upstream: Some(upstream.to_owned()),
                            id: route_id(&r.source, upstream),
                        });
                        plan.routes.len() - 1
                    }
                };
                if !routes.contains(&index) {
                    routes.push(index);
                }
            }
            plan.groups.push(GroupSpec {
                name: name.clone(),
                routes,
            });
        }
        let index = |name: &String| cfg.models.keys().position(|k| k == name);
        for (g, (name, model)) in cfg.models.iter().enumerate() {
            let chain = std::iter::once(g)
                .chain(model.fallback.iter().filter_map(index))
                .collect();
            let context = model.context_fallback.iter().filter_map(index).collect();
            let chains = plan.chain(chain, context);
            plan.models.insert(name.clone(), chains);
        }
        plan
    }

    /// The chains over these groups, with their route key.
    fn chain(&self, chain: Vec<usize>, context: Vec<usize>) -> ModelChain {
        let describe = |groups: &[usize]| -> String {
            groups
                .iter()
                .map(|&g| {
                    let routes: Vec<String> = self.groups[g]
                        .routes
                        .iter()
                        .map(|&r| {
                            let r = &self.routes[r];
                            format!("{}:{}", r.id, r.upstream.as_deref().unwrap_or("*"))
                        })
                        .collect();
                    format!("{}=[{}]", self.groups[g].name, routes.join(","))
                })
                .collect::<Vec<_>>()
                .join(";")
        };
        let route_key = format!("{}|{}", describe(&chain), describe(&context));
        ModelChain {
            chain,
            context,
            route_key,
        }
    }
}

/// The id of the route serving `upstream` on `source`: `source/upstream` (the key of
/// its breaker, health and holds). Without `[models]` a source is its own route and
/// keeps its name.
pub(crate) fn route_id(source: &str, upstream: &str) -> SourceId {
    SourceId::from(format!("{source}/{upstream}"))
}

/// What the last 429 of a route said about its scope: set by the attempt, read (and
/// cleared) by the hold that follows it in the same call. Two calls' 429s on one route
/// racing can swap their scopes; both are 429s of that route, so at worst one hold is
/// a route's instead of the account's, and the account's next 429 says so again.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pushback(Arc<AtomicBool>);

impl Pushback {
    /// Notes a 429's error: account-wide or not.
    pub(crate) fn note(&self, err: &(dyn std::error::Error + 'static), model: &str) {
        self.0.store(account_wide(err, model), Ordering::Relaxed);
    }

    fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

/// Whether a 429 says the limit is the account's (organization's) as a whole, not the
/// model's or the key's: its message names the organization or account and not the
/// model asked (OpenAI: "Rate limit reached for gpt-4o in organization org-x on tokens
/// per min" is that model's limit in the organization; "... for account a" is the
/// account's).
///
/// ```text
/// "Rate limit reached for account acct-a. Please slow down."          -> account
/// "Rate limit reached for gpt-4o in organization org-1 on requests"   -> the route
/// "Rate limit reached for requests on source s4"                      -> the route
/// ```
pub(crate) fn account_wide(err: &(dyn std::error::Error + 'static), model: &str) -> bool {
    let Some(status) = UpstreamStatus::find(err) else {
        return false;
    };
    // The model as a word of the message, not a substring ("m" is in "limit").
    let message = status.message().to_ascii_lowercase();
    let model = model.to_ascii_lowercase();
    let names_model = !model.is_empty()
        && message
            .split(|c: char| c.is_whitespace() || matches!(c, ',' | ';' | '(' | ')' | '"' | '\''))
            .any(|w| w.trim_end_matches(['.', ':']) == model);
    pgw_core::pushback_is_account_wide(err) && !names_model
}

/// The long hold of a source whose account has no credit left (`insufficient_quota`,
/// [`pgw_core::is_quota_exhausted`]): its breaker opens at once (the answer is
/// `SourceDead`), but the breaker's cooldown would let a probe through after seconds,
/// and every process would spend an attempt finding the account still broke. The
/// source's limiter holds it (every model of the key, in every process sharing the
/// backend) for `duration`; then the breaker, half-open by then, sends one probe.
#[derive(Clone, Debug)]
pub(crate) struct QuotaHold {
    /// The source's limiter (its scope, not its account's: the answer names the key's
    /// billing, and each sibling of an account finds out with its own one answer).
    pub(crate) limiter: RateLimiter,
    /// How long (`breaker.quota_hold_s`).
    pub(crate) duration: Duration,
}

impl QuotaHold {
    /// The hold to write when `err` says the source's account has no credit, `None`
    /// otherwise. A hold that cannot be written (the backend is down) is logged: the
    /// breaker, open already, still keeps the source out for its cooldown.
    pub(crate) fn after(
        &self,
        err: &(dyn std::error::Error + 'static),
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        if !pgw_core::is_quota_exhausted(err) {
            return None;
        }
        let (limiter, duration) = (self.limiter.clone(), self.duration);
        Some(async move {
            if let Err(e) = limiter.hold(HoldScope::Source, duration).await {
                tracing::warn!(source = %limiter.source(), error = %e, "quota hold not written");
            }
        })
    }
}

/// One route as [`RouteHolds`] sees it.
#[derive(Clone, Debug)]
pub(crate) struct RouteHold {
    /// The source's limiter (its quotas, its account).
    pub(crate) source: RateLimiter,
    /// The route's own hold scope, when the route is not the whole source.
    pub(crate) route: Option<RateLimiter>,
    /// The scope of the route's last 429.
    pub(crate) pushback: Pushback,
}

/// The retry layer's hold hook over every route: a 429 holds the route it came from
/// (its source and upstream model), so the source's other models stay admitted; when
/// the provider says the limit is the account's, it holds the account (every source
/// and model of it). One round trip either way.
#[derive(Clone, Debug, Default)]
pub(crate) struct RouteHolds {
    pub(crate) routes: Arc<HashMap<SourceId, RouteHold>>,
}

/// A route the hold hook does not know.
#[derive(Debug)]
struct UnknownRoute(String);

impl std::fmt::Display for UnknownRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no route {:?} to hold", self.0)
    }
}

impl std::error::Error for UnknownRoute {}

impl Hold for RouteHolds {
    fn hold(&self, route: &SourceId, duration: Duration) -> HoldFuture {
        self.hold_route(route, duration, false)
    }

    /// As [`hold`](Hold::hold) (this hook tells the account's pushback from the
    /// route's itself), the reason kept: the calls it refuses are told the provider is
    /// overloaded ([`RateLimiter::hold_after_overload`]).
    fn hold_after_overload(&self, route: &SourceId, duration: Duration, _account_wide: bool) -> HoldFuture {
        self.hold_route(route, duration, true)
    }
}

impl RouteHolds {
    fn hold_route(&self, route: &SourceId, duration: Duration, overloaded: bool) -> HoldFuture {
        let Some(r) = self.routes.get(route) else {
            let e: BoxError = Box::new(UnknownRoute(route.to_string()));
            return Box::pin(std::future::ready(Err(e)));
        };
        let (limiter, scope) = match (r.pushback.take(), &r.route) {
            // The account's limit: every source and model of it (the source alone
            // when it has no account: the key's limit, all its models).
            (true, Some(_)) => (r.source.clone(), HoldScope::Account),
            (true, None) => (r.source.clone(), HoldScope::Both),
            (false, Some(route)) => (route.clone(), HoldScope::Source),
            (false, None) => (r.source.clone(), HoldScope::Source),
        };
        Box::pin(async move {
            let held = if overloaded {
                limiter.hold_after_overload(scope, duration).await
            } else {
                limiter.hold(scope, duration).await
            };
            held.map(|_| ()).map_err(|e| Box::new(e) as BoxError)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgw_core::ProviderError;

    fn too_many(message: &str) -> BoxError {
        Box::new(
            UpstreamStatus::new(http::StatusCode::TOO_MANY_REQUESTS, None, message).with_provider(
                ProviderError {
                    message: message.into(),
                    code: Some("rate_limit_exceeded".into()),
                    ..ProviderError::default()
                },
            ),
        )
    }

    #[test]
    fn only_an_account_limit_that_names_no_model_is_account_wide() {
        let account = too_many("Rate limit reached for account acct-a. Please slow down.");
        assert!(account_wide(&*account, "gpt-4o"));
        let org = too_many("Rate limit reached for organization org-1 on requests per min (RPM)");
        assert!(account_wide(&*org, "gpt-4o"));
        let model_in_org =
            too_many("Rate limit reached for gpt-4o in organization org-1 on tokens per min (TPM)");
        assert!(!account_wide(&*model_in_org, "gpt-4o"));
        let key = too_many("Rate limit reached for requests on source s4");
        assert!(!account_wide(&*key, "gpt-4o"));
        let plain: BoxError = "connection reset".into();
        assert!(!account_wide(&*plain, "gpt-4o"));
        // A one-letter model is a word, not a substring of "limit".
        assert!(account_wide(
            &*too_many("Rate limit reached for account acct. Please slow down."),
            "m"
        ));
    }

    #[test]
    fn a_route_id_names_source_and_model() {
        assert_eq!(route_id("s1", "gpt-4o").as_str(), "s1/gpt-4o");
    }
}
