//! Connection strings with several hosts (a primary and its standbys), tried one host at a time:
//! tokio-postgres bounds only each host's TCP connect, so a host that accepts and then never
//! answers (a frozen server) would hold every new session until the pool gave up, never reaching
//! the next host. Here each host but the last has `host_timeout` for the whole handshake.

use std::time::Duration;

use futures_util::future::BoxFuture;
use postgres_openssl::MakeTlsConnector;
use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};

/// A session's connection, which the caller spawns.
pub type Session = Connection<Socket, <MakeTlsConnector as MakeTlsConnect<Socket>>::Stream>;

/// How many hosts `cfg` names (by name or by address).
pub fn count(cfg: &Config) -> usize {
    cfg.get_hosts().len().max(cfg.get_hostaddrs().len())
}

/// Connects to the hosts of `cfg` in order: each but the last within `host_timeout` (a failure or
/// a timeout is logged and the next host tried), the last within the caller's own bound.
pub async fn connect(
    cfg: &Config,
    tls: &MakeTlsConnector,
    host_timeout: Duration,
) -> Result<(Client, Session), tokio_postgres::Error> {
    let n = count(cfg);
    if n <= 1 {
        return cfg.connect(tls.clone()).await;
    }
    for i in 0..n - 1 {
        let host = one_host(cfg, i);
        match tokio::time::timeout(host_timeout, host.connect(tls.clone())).await {
            Ok(Ok(session)) => return Ok(session),
            Ok(Err(e)) => {
                tracing::warn!(host = %crate::db::describe(&host), "database host failed, trying the next: {}", crate::db::one_line(&e))
            }
            Err(_) => {
                tracing::warn!(host = %crate::db::describe(&host), "database host did not answer within {host_timeout:?}, trying the next")
            }
        }
    }
    one_host(cfg, n - 1).connect(tls.clone()).await
}

/// The pool's way to open a session: [`connect`] with the target's hosts and bound.
pub struct PoolConnect(pub crate::db::Target);

impl deadpool_postgres::Connect for PoolConnect {
    fn connect(
        &self,
        _cfg: &Config,
    ) -> BoxFuture<'_, Result<(Client, JoinHandle<()>), tokio_postgres::Error>> {
        Box::pin(async move {
            let (client, session) = self.0.connect().await?;
            Ok((client, tokio::spawn(async move { drop(session.await) })))
        })
    }
}

/// `cfg` with its `i`-th host only (its name, address and port), every other setting kept.
pub fn one_host(cfg: &Config, i: usize) -> Config {
    let mut one = Config::new();
    match cfg.get_hosts().get(i) {
        Some(Host::Tcp(name)) => {
            one.host(name);
        }
        Some(Host::Unix(path)) => {
            one.host_path(path);
        }
        None => {}
    }
    if let Some(addr) = cfg.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    // One port for every host, or one each.
    let ports = cfg.get_ports();
    if let Some(port) = ports.get(i).or(ports.first().filter(|_| ports.len() == 1)) {
        one.port(*port);
    }
    copy_settings(cfg, &mut one);
    one
}

/// Everything of `from` but its hosts, addresses and ports.
fn copy_settings(from: &Config, to: &mut Config) {
    if let Some(v) = from.get_user() {
        to.user(v);
    }
    if let Some(v) = from.get_password() {
        to.password(v);
    }
    if let Some(v) = from.get_dbname() {
        to.dbname(v);
    }
    if let Some(v) = from.get_options() {
        to.options(v);
    }
    if let Some(v) = from.get_application_name() {
        to.application_name(v);
    }
    if let Some(v) = from.get_connect_timeout() {
        to.connect_timeout(*v);
    }
    if let Some(v) = from.get_tcp_user_timeout() {
        to.tcp_user_timeout(*v);
    }
    if let Some(v) = from.get_keepalives_interval() {
        to.keepalives_interval(v);
    }
    if let Some(v) = from.get_keepalives_retries() {
        to.keepalives_retries(v);
    }
    to.ssl_mode(from.get_ssl_mode())
        .ssl_negotiation(from.get_ssl_negotiation())
        .keepalives(from.get_keepalives())
        .keepalives_idle(from.get_keepalives_idle())
        .target_session_attrs(from.get_target_session_attrs())
        .channel_binding(from.get_channel_binding())
        .load_balance_hosts(from.get_load_balance_hosts());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    const SETTINGS: &str = "user=u password=secret dbname=orders options=-cx=1 \
        application_name=app sslmode=require connect_timeout=3 target_session_attrs=read-write \
        keepalives_idle=7 keepalives_interval=2 keepalives_retries=4 tcp_user_timeout=9 \
        channel_binding=disable";

    #[test]
    fn each_host_keeps_every_setting_and_its_own_port() {
        let all = Config::from_str(&format!("host=a,b,/tmp port=1,2,3 {SETTINGS}")).unwrap();
        assert_eq!(count(&all), 3);
        for (i, host) in ["host=a port=1", "host=b port=2", "host=/tmp port=3"]
            .iter()
            .enumerate()
        {
            let want = Config::from_str(&format!("{host} {SETTINGS}")).unwrap();
            assert_eq!(one_host(&all, i), want, "host {i}");
        }
    }

    #[test]
    fn one_port_serves_every_host_and_addresses_go_with_their_host() {
        let all = Config::from_str("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=5433").unwrap();
        let want = Config::from_str("host=b hostaddr=10.0.0.2 port=5433").unwrap();
        assert_eq!(one_host(&all, 1), want);
        let none = Config::from_str("host=a,b").unwrap();
        assert_eq!(one_host(&none, 1), Config::from_str("host=b").unwrap());
    }
}
