//! Routes: a source serving one upstream model, the unit the breaker, the health
//! EWMA and 429 holds are kept for; and [`RouteHolds`], the retry layer's hold hook
//! that holds a route, every route of its account serving its model when the provider
//! says the limit is that model's in the account, or the whole account when it says
//! the limit is the account's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
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

/// Whose limit a 429 met, as its message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum LimitScope {
    /// The key's or the deployment's own limit (or the message does not say): the
    /// route alone is held.
    Route = 0,
    /// The model's limit in the organization or account ("Rate limit reached for
    /// gpt-4o in organization org-1 on tokens per min"): every key of the account
    /// shares it, so every route of the account serving that model is held.
    ModelInAccount = 1,
    /// The account's limit as a whole ("Rate limit reached for account acct-a"): every
    /// source and model of it is held.
    Account = 2,
}

/// What the last 429 of a route said about its scope: set by the attempt, read (and
/// cleared) by the hold that follows it in the same call. Two calls' 429s on one route
/// racing can swap their scopes; both are 429s of that route, so at worst one hold is
/// narrower than it should be, and the account's next 429 says so again.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pushback(Arc<AtomicU8>);

impl Pushback {
    /// Notes a 429's error: whose limit it met.
    pub(crate) fn note(&self, err: &(dyn std::error::Error + 'static), model: &str) {
        self.0.store(limit_scope(err, model) as u8, Ordering::Relaxed);
    }

    fn take(&self) -> LimitScope {
        match self.0.swap(LimitScope::Route as u8, Ordering::Relaxed) {
            2 => LimitScope::Account,
            1 => LimitScope::ModelInAccount,
            _ => LimitScope::Route,
        }
    }
}

/// Whose limit a 429 met ([`LimitScope`]): the account's when its message names the
/// organization or account ([`pgw_core::pushback_is_account_wide`]), as a whole unless
/// it also names the model asked (OpenAI: "Rate limit reached for gpt-4o in
/// organization org-x on tokens per min" is that model's limit in the organization,
/// shared by every key of it; "... for account a" is the account's).
///
/// ```text
/// "Rate limit reached for account acct-a. Please slow down."          -> Account
/// "Rate limit reached for gpt-4o in organization org-1 on requests"   -> ModelInAccount
/// "Rate limit reached for requests on source s4"                      -> Route
/// ```
///
/// Holding only the route on a model's limit in the organization (as pgw did until
/// 2026-12-04) left the account's other keys sending that model's short calls into the
/// refilled quota: on the soak's account-429 storm (three keys of one organization, a
/// 400k TPM limit, 100k-token prompts among short ones) a long prompt met a 429 at
/// every try until its pushback bound ended it (111 calls of 37,500 over 25 seeds; 0
/// with the model held on every key of the organization).
pub(crate) fn limit_scope(err: &(dyn std::error::Error + 'static), model: &str) -> LimitScope {
    let Some(status) = UpstreamStatus::find(err) else {
        return LimitScope::Route;
    };
    if !pgw_core::pushback_is_account_wide(err) {
        return LimitScope::Route;
    }
    // The model as a word of the message, not a substring ("m" is in "limit"), in any
    // of its spellings ([`same_model`]).
    let message = status.message().to_ascii_lowercase();
    let model = model.to_ascii_lowercase();
    let names_model = !model.is_empty()
        && message
            .split(|c: char| c.is_whitespace() || matches!(c, ',' | ';' | '(' | ')' | '"' | '\''))
            .any(|w| same_model(w.trim_end_matches(['.', ':']), &model));
    if names_model {
        LimitScope::ModelInAccount
    } else {
        LimitScope::Account
    }
}

/// Whether `word` of a 429's message names `model` (both lowercase): the same name,
/// or the model's family when the model is a dated snapshot of it (OpenAI names
/// `gpt-4o` in "Rate limit reached for gpt-4o in organization ..." when
/// `gpt-4o-2024-08-06` was asked; `gpt-3.5-turbo-0125` is `gpt-3.5-turbo`'s), also
/// with the `default-` OpenAI's older messages put before it. Another model of the
/// family (`gpt-4o-mini`) is not the same one: its limit is its own.
fn same_model(word: &str, model: &str) -> bool {
    let word = word.strip_prefix("default-").unwrap_or(word);
    word == model
        || model
            .strip_prefix(word)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|date| !date.is_empty() && date.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
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
    /// The model the route sends upstream (`None`: the caller's).
    pub(crate) upstream: Option<String>,
    /// The scope of the route's last 429.
    pub(crate) pushback: Pushback,
}

/// The retry layer's hold hook over every route: a 429 holds the route it came from
/// (its source and upstream model), so the source's other models stay admitted; when
/// the provider says the limit is that model's in the account, every route of the
/// account serving that model (one round trip each, sent together); when it says the
/// limit is the account's, the account (every source and model of it, one round trip).
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
        let holds: Vec<(RateLimiter, HoldScope)> = match (r.pushback.take(), &r.route) {
            // The account's limit: every source and model of it (the source alone
            // when it has no account: the key's limit, all its models).
            (LimitScope::Account, Some(_)) => vec![(r.source.clone(), HoldScope::Account)],
            // Without `[models]` a route is its source, every model of it: the
            // account's hold is the narrowest that holds the model on every key.
            (LimitScope::Account | LimitScope::ModelInAccount, None) => {
                vec![(r.source.clone(), HoldScope::Both)]
            }
            (LimitScope::ModelInAccount, Some(_)) => self.model_in_account(r),
            (LimitScope::Route, Some(route)) => vec![(route.clone(), HoldScope::Source)],
            (LimitScope::Route, None) => vec![(r.source.clone(), HoldScope::Source)],
        };
        Box::pin(async move {
            let writes = holds.into_iter().map(|(limiter, scope)| async move {
                if overloaded {
                    limiter.hold_after_overload(scope, duration).await
                } else {
                    limiter.hold(scope, duration).await
                }
            });
            for held in futures_util::future::join_all(writes).await {
                held.map_err(|e| Box::new(e) as BoxError)?;
            }
            Ok(())
        })
    }

    /// The holds for a model's limit in `r`'s account: every route of the account
    /// that serves `r`'s upstream model (`r` itself when its source has no account).
    fn model_in_account(&self, r: &RouteHold) -> Vec<(RateLimiter, HoldScope)> {
        let own = |h: &RouteHold| h.route.clone().unwrap_or_else(|| h.source.clone());
        let Some(account) = r.source.config().account_name() else {
            return vec![(own(r), HoldScope::Source)];
        };
        self.routes
            .values()
            .filter(|h| h.upstream == r.upstream && h.source.config().account_name() == Some(account))
            .map(|h| (own(h), HoldScope::Source))
            .collect()
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
    fn a_429_names_the_account_the_model_in_it_or_neither() {
        let account = too_many("Rate limit reached for account acct-a. Please slow down.");
        assert_eq!(limit_scope(&*account, "gpt-4o"), LimitScope::Account);
        let org = too_many("Rate limit reached for organization org-1 on requests per min (RPM)");
        assert_eq!(limit_scope(&*org, "gpt-4o"), LimitScope::Account);
        let model_in_org =
            too_many("Rate limit reached for gpt-4o in organization org-1 on tokens per min (TPM)");
        assert_eq!(limit_scope(&*model_in_org, "gpt-4o"), LimitScope::ModelInAccount);
        // Another model's limit named in the organization: not this model's, the
        // organization's as far as this call can tell.
        assert_eq!(limit_scope(&*model_in_org, "gpt-4o-mini"), LimitScope::Account);
        // The model asked as a dated snapshot of the family the message names: its
        // limit (it held the whole account, every model of it).
        assert_eq!(
            limit_scope(&*model_in_org, "gpt-4o-2024-08-06"),
            LimitScope::ModelInAccount
        );
        let older = too_many(
            "Rate limit reached for default-gpt-3.5-turbo in organization org-1 on requests per min.",
        );
        assert_eq!(
            limit_scope(&*older, "gpt-3.5-turbo-0125"),
            LimitScope::ModelInAccount
        );
        assert_eq!(
            limit_scope(&*older, "gpt-3.5-turbo-instruct"),
            LimitScope::Account
        );
        let key = too_many("Rate limit reached for requests on source s4");
        assert_eq!(limit_scope(&*key, "gpt-4o"), LimitScope::Route);
        let plain: BoxError = "connection reset".into();
        assert_eq!(limit_scope(&*plain, "gpt-4o"), LimitScope::Route);
        // A one-letter model is a word, not a substring of "limit".
        assert_eq!(
            limit_scope(
                &*too_many("Rate limit reached for account acct. Please slow down."),
                "m"
            ),
            LimitScope::Account
        );
    }

    /// Routes as the builder makes them with `[models]`: each source's limiter (with
    /// its account) and each route's own hold scope.
    fn routes(specs: &[(&str, &str, Option<&str>)]) -> RouteHolds {
        let backend = tower_ratelimit_redis::MemoryBackend::new();
        let mut routes = HashMap::new();
        for &(source, model, account) in specs {
            let mut config = tower_ratelimit_redis::RateLimitConfig::new(
                source,
                tower_ratelimit_redis::Quota::unlimited(),
            );
            if let Some(a) = account {
                config = config.account(a, tower_ratelimit_redis::Quota::unlimited());
            }
            let id = route_id(source, model);
            let route = tower_ratelimit_redis::RateLimitConfig::new(
                id.as_str(),
                tower_ratelimit_redis::Quota::unlimited(),
            );
            routes.insert(
                id,
                RouteHold {
                    source: RateLimiter::new(config, backend.clone()).unwrap(),
                    route: Some(RateLimiter::new(route, backend.clone()).unwrap()),
                    upstream: Some(model.to_owned()),
                    pushback: Pushback::default(),
                },
            );
        }
        RouteHolds {
            routes: Arc::new(routes),
        }
    }

    async fn held(holds: &RouteHolds, route: &str) -> bool {
        let r = &holds.routes[&SourceId::from(route)];
        let route = r.route.as_ref().unwrap().acquire(0).await;
        let source = r.source.acquire(0).await;
        route.is_err() || source.is_err()
    }

    #[tokio::test(start_paused = true)]
    async fn a_models_limit_in_the_account_holds_that_model_on_every_key_of_it() {
        let holds = routes(&[
            ("k1", "gpt-4o", Some("org")),
            ("k2", "gpt-4o", Some("org")),
            ("k2", "gpt-4o-mini", Some("org")),
            ("k3", "gpt-4o", Some("other")),
        ]);
        let first = SourceId::from("k1/gpt-4o");
        holds.routes[&first].pushback.note(
            &*too_many("Rate limit reached for gpt-4o in organization org on tokens per min (TPM)"),
            "gpt-4o",
        );
        holds.hold(&first, Duration::from_secs(20)).await.unwrap();
        assert!(held(&holds, "k1/gpt-4o").await);
        assert!(
            held(&holds, "k2/gpt-4o").await,
            "the model on the account's other key"
        );
        assert!(
            !held(&holds, "k2/gpt-4o-mini").await,
            "another model of the account"
        );
        assert!(!held(&holds, "k3/gpt-4o").await, "the model on another account");
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(!held(&holds, "k2/gpt-4o").await, "for the time asked");

        // The key's own limit holds the route alone.
        holds.routes[&first].pushback.note(
            &*too_many("Rate limit reached for requests on source k1"),
            "gpt-4o",
        );
        holds.hold(&first, Duration::from_secs(20)).await.unwrap();
        assert!(held(&holds, "k1/gpt-4o").await);
        assert!(!held(&holds, "k2/gpt-4o").await);
    }

    #[test]
    fn the_scope_noted_is_taken_once() {
        let p = Pushback::default();
        p.note(
            &*too_many("Rate limit reached for gpt-4o in organization org-1 on tokens per min (TPM)"),
            "gpt-4o",
        );
        assert_eq!(p.take(), LimitScope::ModelInAccount);
        assert_eq!(p.take(), LimitScope::Route, "cleared by the hold that read it");
    }

    #[test]
    fn a_route_id_names_source_and_model() {
        assert_eq!(route_id("s1", "gpt-4o").as_str(), "s1/gpt-4o");
    }
}
