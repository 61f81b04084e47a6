//! The encoder against the real kernel, each test in its own network namespace (netns.rs).

use splitproxy_proto::v1::Family;

use super::fixture;
use super::netns;
use crate::nft::{Batch, NftSocket};

#[test]
fn kernel_loads_the_splitproxy_table() {
    netns::run("kernel_loads_the_splitproxy_table", |ns| {
        let mut sock = NftSocket::open().unwrap();
        let mut batch = Batch::new();
        fixture::add_table(&mut batch, &fixture::table()).unwrap();
        sock.commit(&batch).unwrap();
        println!("{}", ns.nft(&["list", "ruleset"]));
        println!("{}", ns.nft(&["-j", "list", "ruleset"]));
        let _ = Family::Ip;
    });
}
