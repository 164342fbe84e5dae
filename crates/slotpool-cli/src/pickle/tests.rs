//! The pickle machine on small pickles written by Python 3.

use super::*;

fn load(bytes: &[u8], prune: &[&str]) -> Result<Graph> {
    Unpickler::new(bytes).prune_keys(prune).load()
}

#[test]
fn longs_and_bigints() {
    // LONG1 of 3 bytes, negative (00 00 ff = -65536).
    let g = load(b"\x80\x02\x8a\x03\x00\x00\xff.", &[]).unwrap();
    assert_eq!(g.root, Some(Val::Int(-65536)));
    // 2**64 (9 bytes): beyond u64.
    let g = load(
        b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.",
        &[],
    )
    .unwrap();
    let root = g.root.unwrap();
    assert_eq!(g.u64(root), None);
    assert_eq!(g.type_name(root), "an int");
    // 2**63 as 9 bytes with a zero top byte: fits u64.
    let g = load(
        b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.",
        &[],
    )
    .unwrap();
    assert_eq!(g.u64(g.root.unwrap()), Some(1 << 63));
}

#[test]
fn protocol_0_text_opcodes() {
    // pickle.dumps({'a': [1, 2.5, 'x']}, 0)
    let p = b"(dp0\nVa\np1\n(lp2\nI1\naF2.5\naVx\np3\nas.";
    let g = load(p, &[]).unwrap();
    let root = g.root.unwrap();
    let list = g.get(root, "a").unwrap();
    let items = g.seq(list).unwrap();
    assert_eq!(items[0], Val::Int(1));
    assert_eq!(items[1], Val::Float(2.5));
    assert_eq!(g.str(items[2]), Some("x"));
}

#[test]
fn memo_shares_and_prune_drops() {
    // pickle.dumps({'frames': [f, f], 'keep': [f]}, 4) where f = {'n': 1}
    let p = b"\x80\x04\x95)\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x06frames\x94]\x94(}\x94\x8c\x01n\x94K\x01sh\x03e\x8c\x04keep\x94]\x94h\x03au.";
    let g = load(p, &[]).unwrap();
    let root = g.root.unwrap();
    let frames = g.seq(g.get(root, "frames").unwrap()).unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0], frames[1], "one object, shared through the memo");
    let g = load(p, &["frames"]).unwrap();
    let root = g.root.unwrap();
    let frames = g.get(root, "frames").unwrap();
    assert_eq!(g.obj(frames), Some(&Obj::Pruned(Kind::List)));
    assert_eq!(g.type_name(frames), "a list");
    // The frame dict was created inside the pruned list: pruned too, wherever it is used.
    let keep = g.seq(g.get(root, "keep").unwrap()).unwrap();
    assert_eq!(g.obj(keep[0]), Some(&Obj::Pruned(Kind::Dict)));
}

#[test]
fn bad_input_is_an_error() {
    assert!(matches!(
        load(b"\x80\x04}", &[]),
        Err(PickleError::Truncated(3))
    ));
    assert!(matches!(
        load(b"0.", &[]),
        Err(PickleError::Bad { at: 0, .. })
    ));
    assert!(matches!(load(b"h\x05.", &[]), Err(PickleError::Bad { .. })));
    assert!(matches!(load(b"\xff.", &[]), Err(PickleError::Bad { .. })));
    assert!(matches!(
        load(b"K\x01a.", &[]),
        Err(PickleError::Bad { .. })
    ));
    assert!(load(b"(K\x01K\x02d.", &[]).is_ok());
    assert!(matches!(
        load(b"(K\x01d.", &[]),
        Err(PickleError::Bad { .. })
    ));
    assert!(matches!(
        load(b"K\x01r\xff\xff\xff\x7f.", &[]),
        Err(PickleError::Bad { .. })
    ));
    assert!(matches!(
        load(b"\x80\x09.", &[]),
        Err(PickleError::Bad { .. })
    ));
}

#[test]
fn classes_are_opaque() {
    // pickle.dumps(collections.OrderedDict(a=1), 2)
    let p = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01X\x01\x00\x00\x00aq\x02K\x01s.";
    let g = load(p, &[]).unwrap();
    let root = g.root.unwrap();
    assert_eq!(
        g.obj(root),
        Some(&Obj::Instance("collections.OrderedDict".into()))
    );
    assert_eq!(g.type_name(root), "an object");
}
