//! The job token's handshake between the hub and its clients: intruders with a wrong token
//! or none, a token on one side only, a fuzzed handshake (closed, truncated, oversized,
//! malformed, replayed, idle), a fake hub, the door's limit, and a formation that times
//! out naming what was refused.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::auth::{client_side, JobToken, Refusal};
use super::gate::Gate;
use super::wire::{read_frame, to_client, to_hub, write_frame};
use super::{join, Hello, Hub, Watch};

const LONG: Duration = Duration::from_secs(10);

fn token(secret: &str) -> JobToken {
    JobToken::new(secret).unwrap()
}

fn hub(world: usize, token: Option<JobToken>, timeout: Duration) -> Hub {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    Hub::start(listener, world, "build A", token, timeout).unwrap()
}

fn hello(rank: usize, world_size: usize) -> Hello {
    Hello {
        rank,
        world_size,
        version: "build A".into(),
        info: vec![rank as u8],
    }
}

/// The hub's refusals once it has counted `n` (its door runs on threads of its own).
fn refused(hub: &Hub, n: usize) -> BTreeMap<Refusal, usize> {
    let start = Instant::now();
    loop {
        let got = hub.refused();
        if got.values().sum::<usize>() >= n || start.elapsed() > LONG {
            return got;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Ranks `0..world` join with `token` at once; every rank's infos.
fn form(addr: &str, world: usize, token: &JobToken) -> Vec<Vec<Vec<u8>>> {
    std::thread::scope(|s| {
        let joins: Vec<_> = (0..world)
            .map(|r| s.spawn(move || join(addr, &hello(r, world), Some(token), LONG)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap().expect("a rank with the token joins").1)
            .collect()
    })
}

#[test]
fn only_connections_that_prove_the_token_join() {
    let right = token("the job's secret");
    let h = hub(2, Some(right.clone()), LONG);
    let addr = h.addr().to_string();
    let wrong = join(&addr, &hello(1, 2), Some(&token("another")), LONG).unwrap_err();
    let wrong = wrong.to_string();
    assert!(wrong.contains("job token differs from rank 0's"), "{wrong}");
    let none = join(&addr, &hello(1, 2), None, LONG)
        .unwrap_err()
        .to_string();
    assert!(
        none.contains("requires a job token") && none.contains("set FUSION_JOB_TOKEN to"),
        "{none}"
    );
    let watch = Watch::open(&addr, 0, Some(&token("another")), LONG).unwrap_err();
    assert!(watch.to_string().contains("job token differs"), "{watch}");
    // The world forms as if they had not come.
    for infos in form(&addr, 2, &right) {
        assert_eq!(infos, vec![vec![0], vec![1]]);
    }
    Watch::open(&addr, 0, Some(&right), LONG).unwrap().close();
    let counts = refused(&h, 3);
    assert_eq!(counts.get(&Refusal::WrongToken), Some(&2), "{counts:?}");
    assert_eq!(counts.get(&Refusal::NoToken), Some(&1), "{counts:?}");
    assert_eq!(counts.values().sum::<usize>(), 3, "{counts:?}");
}

#[test]
fn a_token_on_one_side_only_is_named() {
    let h = hub(1, None, LONG);
    let addr = h.addr().to_string();
    let e = join(&addr, &hello(0, 1), Some(&token("t")), LONG).unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("rank 0's process has none") && e.contains("same FUSION_JOB_TOKEN,"),
        "{e}"
    );
    assert_eq!(refused(&h, 1).get(&Refusal::UnexpectedToken), Some(&1));
    // Without a token the world forms as it always did.
    assert_eq!(
        join(&addr, &hello(0, 1), None, LONG).unwrap().1,
        vec![vec![0]]
    );
}

/// A frame of `payload` (the wire's length prefix and the bytes).
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    write_frame(&mut f, payload).unwrap();
    f
}

/// A connection to `addr` that reads the hub's challenge (if `read_challenge`), sends
/// `bytes` and keeps the connection open (returned) or closes it.
fn raw(addr: SocketAddr, read_challenge: bool, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    if read_challenge {
        read_frame(&mut s).unwrap().expect("a challenge");
    }
    s.write_all(bytes).unwrap();
    s
}

/// A genuine proof of `token`, recorded by a fake hub on a connection of its own (for a
/// replay): the frame's bytes.
fn recorded_proof(token: &JobToken) -> Vec<u8> {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut c = TcpStream::connect(&addr).unwrap();
            let _ = client_side(&mut c, Some(token), &addr, LONG);
        });
        let (mut conn, _) = fake.accept().unwrap();
        let mut challenge = vec![to_client::CHALLENGE, 1];
        challenge.extend_from_slice(&[7; 32]);
        write_frame(&mut conn, &challenge).unwrap();
        frame(&read_frame(&mut conn).unwrap().expect("a proof"))
    })
}

#[test]
fn a_fuzzed_handshake_is_refused_and_the_world_forms_regardless() {
    let right = token("the job's secret");
    // The door gives a handshake min(10 s, timeout): the idle connection is refused after 4 s.
    let h = hub(2, Some(right.clone()), Duration::from_secs(4));
    let addr = h.addr();
    let idle = TcpStream::connect(addr).unwrap();
    drop(TcpStream::connect(addr).unwrap());
    let mut cut = frame(&[to_hub::PROOF, 1]);
    cut[0] = 66; // a proof's length, cut short by the end of the connection
    let open = [
        raw(addr, true, &cut),
        raw(addr, true, &frame(&[to_hub::PROOF, 1, 9, 9, 9])),
        raw(addr, false, &u32::MAX.to_le_bytes()),
        raw(addr, false, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        raw(addr, true, &frame(&[to_hub::HELLO, 0, 0, 0])),
        raw(addr, true, &recorded_proof(&right)),
    ];
    for mut s in open {
        let _ = s.shutdown(std::net::Shutdown::Write);
        // Whatever the hub answers, it then closes the connection.
        while let Ok(Some(_)) = read_frame(&mut s) {}
    }
    for infos in form(&addr.to_string(), 2, &right) {
        assert_eq!(infos, vec![vec![0], vec![1]]);
    }
    let counts = refused(&h, 8);
    drop(idle);
    let expect = [
        (Refusal::Closed, 1),
        (Refusal::Truncated, 2),
        (Refusal::Oversized, 2),
        (Refusal::Malformed, 1),
        (Refusal::WrongToken, 1),
        (Refusal::TimedOut, 1),
    ];
    assert_eq!(counts, BTreeMap::from(expect), "{counts:?}");
}

#[test]
fn a_hub_that_cannot_prove_the_token_is_not_trusted() {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    let e = std::thread::scope(|s| {
        let client = s.spawn(|| {
            let mut c = TcpStream::connect(&addr).unwrap();
            client_side(&mut c, Some(&token("t")), &addr, LONG)
        });
        let (mut conn, _) = fake.accept().unwrap();
        let mut challenge = vec![to_client::CHALLENGE, 1];
        challenge.extend_from_slice(&[1; 32]);
        write_frame(&mut conn, &challenge).unwrap();
        read_frame(&mut conn).unwrap().expect("a proof");
        let mut proven = vec![to_client::PROVEN];
        proven.extend_from_slice(&[0; 32]);
        write_frame(&mut conn, &proven).unwrap();
        client.join().unwrap().unwrap_err().to_string()
    });
    assert!(
        e.contains("did not prove that it knows the job token"),
        "{e}"
    );
}

#[test]
fn the_door_holds_a_bounded_number_of_handshakes() {
    let gate = Gate::new(None, LONG);
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let mut passes: Vec<_> = (0..64)
        .map(|_| gate.enter(peer).expect("a place"))
        .collect();
    assert!(gate.enter(peer).is_none(), "the 65th waits for no place");
    passes.pop();
    assert!(
        gate.enter(peer).is_some(),
        "a place given back is taken again"
    );
    assert_eq!(gate.refused(), BTreeMap::from([(Refusal::Busy, 1)]));
}

#[test]
fn a_formation_that_times_out_says_what_was_refused() {
    let h = hub(2, Some(token("a")), Duration::from_secs(1));
    let addr = h.addr().to_string();
    let e1 = join(&addr, &hello(1, 2), Some(&token("b")), LONG).unwrap_err();
    assert!(e1.to_string().contains("job token differs"), "{e1}");
    let e0 = join(&addr, &hello(0, 2), Some(&token("a")), LONG).unwrap_err();
    let e0 = e0.to_string();
    assert!(
        e0.contains("rank 1 never arrived")
            && e0.contains("refused 1 connection: 1 for a wrong job token")
            && e0.contains("job token: FUSION_JOB_TOKEN)"),
        "{e0}"
    );
}
