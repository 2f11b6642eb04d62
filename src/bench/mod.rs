//! `nftproxy bench`: the scale benchmark (see the README's Performance section).

pub mod cluster;
