//! The edge: every listening socket's accept loop, plain and TLS
//! (`listener`), the TLS server config (`tls`), the connection guard
//! (`conn`) and its stand-in for Pingora's bare 400 (`bare`), certificates
//! with SNI, OCSP staples and hot reload (`certs`), rotating session-ticket
//! keys (`ticket`), the DER reading they need (`der`), and
//! `ultrafast certs dev` (`devcerts`), and certificates ordered and
//! renewed through ACME (`acme`), and HTTP/3 (`h3`).

pub mod acme;
mod bare;
pub mod certs;
pub mod conn;
pub mod der;
pub mod devcerts;
pub mod h3;
pub mod hold;
pub mod listener;
pub mod metrics;
mod preface;
pub mod proxy_protocol;
pub mod spool;
pub mod ticket;
pub mod tls;
pub mod upgrade;
mod wbuf;
