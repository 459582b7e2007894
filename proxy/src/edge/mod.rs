//! The edge: TLS termination (`listener`), certificates with SNI, OCSP
//! staples and hot reload (`certs`), rotating session-ticket keys
//! (`ticket`), the DER reading they need (`der`), and `ultrafast certs dev`
//! (`devcerts`).

pub mod certs;
pub mod conn;
pub mod der;
pub mod devcerts;
pub mod listener;
pub mod ticket;
