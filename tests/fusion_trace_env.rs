//! `FUSION_TRACE=<dir>` traces every call without code changes. Alone in its test binary:
//! the variable is read once per process, at the first call, which this test makes.

use fusion::prelude::*;

fusion! {
    fn scale<m>(x: Tensor<f32, [m]>, y: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        x * y
    }
}

#[test]
fn fusion_trace_writes_a_file_per_call_and_rank() {
    let dir = std::env::temp_dir().join(format!("fusion-trace-env-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("FUSION_TRACE", &dir);
    let x = Tensor::randn(&[6], DType::F32, 1);
    World::local(2)
        .unwrap()
        .run(|rank| {
            let t: Ranked<1> = x.clone().try_into()?;
            scale(rank, &t, &t)?;
            scale(rank, &t, &t)?;
            Ok(())
        })
        .unwrap();
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "scale-0000-rank0.json",
            "scale-0000-rank1.json",
            "scale-0001-rank0.json",
            "scale-0001-rank1.json"
        ]
    );
    for f in &files {
        let trace: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap();
        assert!(trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["cat"] == "host"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
